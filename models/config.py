"""Model configuration: one frozen dataclass for the decoder-only family (GPT-2, LLaMA)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

from oases_jax.errors import UserError
from oases_jax.remat import POLICIES as REMAT_POLICIES

FAMILIES = ("gpt2", "llama")
DTYPES = ("float32", "bfloat16")

# Attention kernels: `xla` materialises the scores (einsums and a softmax); `cudnn` is cuDNN's
# fused flash attention (GPUs, bfloat16, head_dim a multiple of 8 up to 128); `auto` takes cudnn
# where it applies on a GPU mesh, a real one or a deviceless compile target alike (the program
# compiled for `h100:8` holds the kernel the GPU run uses), and xla elsewhere (CPU meshes).
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
CHOICES = {"family": FAMILIES, "dtype": DTYPES, "remat": REMAT_POLICIES,
           "attention": ATTENTION_IMPLS}
# Every integer field is a size of at least 1 and every float field a positive finite scale.
# The caps only catch typos and junk: they lie far beyond any published model (docs/cli.md).
SIZE_CAP = 2**20
SIZE_CAPS = {"vocab_size": 2**24, "d_model": 2**17, "n_layers": 2**12}
NONNEGATIVE = ("router_aux_weight", "router_z_weight")  # loss weights: 0 turns a loss off


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer. `family` picks the defaults of the block:

    gpt2:  learned positions, LayerNorm, GELU MLP, biases, tied embeddings.
    llama: RoPE, RMSNorm, SwiGLU MLP, no biases, grouped-query attention, untied head.
    """

    family: str = "gpt2"
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: equal to n_heads (multi-head attention)
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int | None = None  # None: 4 * d_model
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 RoPE scaling (Hugging Face rope_type "llama3"; `models.layers.rope_frequencies`):
    # a factor of 1.0 leaves the frequencies as they are.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool | None = None  # None: the family's default
    vocab_multiple: int = 128  # the embedding table is padded to a multiple of this
    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"
    scan_layers: bool = True
    attention: str = "auto"  # one of ATTENTION_IMPLS
    # Mixture of experts (`models.moe`; None: dense). Every `moe_every`-th layer's MLP is
    # n_experts experts of width moe_d_ff (None: d_ff), top_k of them per token, with
    # capacity_factor * top_k * tokens / n_experts slots per expert and token group; the loss
    # adds router_aux_weight * Switch load-balancing loss + router_z_weight * z-loss per layer.
    n_experts: int | None = None
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 1.25
    moe_d_ff: int | None = None
    router_aux_weight: float = 0.01
    router_z_weight: float = 0.001
    router_norm_topk: bool = False  # renormalise the top-k gates to sum to 1 (Mixtral)

    def __post_init__(self):
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise UserError(f"model {name} {getattr(self, name)!r} is unknown; use one of "
                                f"{', '.join(choices)}")
        for name, (kind, _) in field_kinds().items():
            _check_range(name, kind, getattr(self, name))
        if self.head_dim is None and self.d_model % self.n_heads:
            raise UserError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "set head_dim or change n_heads"
            )
        if self.n_heads % self.kv_heads:
            raise UserError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}; "
                "grouped-query attention needs whole groups"
            )
        if self.family == "llama" and self.k_dim % 2:
            raise UserError(f"RoPE needs an even head_dim, got {self.k_dim}")
        if self.rope_scaling_factor != 1.0:
            self._check_rope_scaling()
        if self.n_experts is not None:
            self._check_moe()

    def _check_moe(self) -> None:
        if self.top_k > self.n_experts:
            raise UserError(f"model top_k={self.top_k} is more than n_experts={self.n_experts}; "
                            f"route each token to at most {self.n_experts} experts")
        if self.n_layers % self.moe_every:
            raise UserError(f"n_layers={self.n_layers} is not a multiple of moe_every="
                            f"{self.moe_every} (one MoE layer ends each group of moe_every); "
                            "change one of them")

    def _check_rope_scaling(self) -> None:
        lo, hi = self.rope_low_freq_factor, self.rope_high_freq_factor
        if self.family != "llama":
            raise UserError(f"rope_scaling_factor={self.rope_scaling_factor} needs the llama "
                            "family (RoPE); leave it at 1.0")
        if not (math.isfinite(self.rope_scaling_factor) and self.rope_scaling_factor > 0
                and math.isfinite(hi) and 0 < lo < hi and self.rope_original_max_len > 0):
            raise UserError(
                f"Llama-3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                f"and original_max_len > 0, got {self.rope_scaling_factor}, {lo}, {hi}, "
                f"{self.rope_original_max_len}; fix them or set rope_scaling_factor=1.0")

    @property
    def fused_attention_fits(self) -> bool:
        """cuDNN's fused attention takes this model: bf16 compute, head_dim a multiple of 8 up
        to 128."""
        return self.dtype == "bfloat16" and self.k_dim % 8 == 0 and self.k_dim <= 128

    def flash_attention(self, *, on_gpu: bool) -> bool:
        """Whether attention runs cuDNN's fused kernel (no scores in memory) on such a device:
        `cudnn`, or `auto` on a GPU (real or a deviceless target) where it fits
        (`fused_attention_fits`)."""
        if self.attention != "auto":
            return self.attention == "cudnn"
        return on_gpu and self.fused_attention_fits

    # Derived values.
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def k_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def moe(self) -> bool:
        return self.n_experts is not None

    @property
    def expert_ff_dim(self) -> int:
        return self.moe_d_ff or self.ff_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every if self.moe else 0

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    @property
    def tied(self) -> bool:
        return self.family == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def learned_positions(self) -> bool:
        return self.family == "gpt2"

    @property
    def use_bias(self) -> bool:
        return self.family == "gpt2"

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    def param_count(self, *, embeddings: bool = True, active: bool = False) -> int:
        """Exact number of parameters of the model this config builds (padded vocab); with
        `active`, an MoE layer counts the top_k experts a token runs through, not all."""
        d, h, g, k, f = self.d_model, self.n_heads, self.kv_heads, self.k_dim, self.ff_dim
        attn = d * (h + 2 * g) * k + h * k * d
        mlp = d * f * (3 if self.gated_mlp else 2)
        norms = 2 * d * (2 if self.use_bias else 1)
        if self.use_bias:
            attn += (h + 2 * g) * k + d
            mlp += f + d
        block = attn + mlp + norms
        total = self.n_layers * block + d * (2 if self.use_bias else 1)
        if self.moe:  # each MoE layer: E expert MLPs of width moe_d_ff and a router, no MLP
            fe = self.expert_ff_dim
            expert = d * fe * (3 if self.gated_mlp else 2) + ((fe + d) if self.use_bias else 0)
            n_experts = self.top_k if active else self.n_experts
            total += self.n_moe_layers * (n_experts * expert + d * self.n_experts - mlp)
        if embeddings:
            total += self.padded_vocab * d * (1 if self.tied else 2)
            if self.learned_positions:
                total += self.max_seq_len * d
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (non-embedding params + lm head) + 12 * layers * seq * H*K
        (forward + backward of the matmuls, attention scores included, causal mask ignored)."""
        matmul_params = (self.param_count(embeddings=False, active=True)
                         + self.padded_vocab * self.d_model)
        return 6.0 * matmul_params + 12.0 * self.n_layers * seq_len * self.n_heads * self.k_dim

    def replace(self, **overrides) -> ModelConfig:
        return dataclasses.replace(self, **overrides)

    def with_overrides(self, pairs: list[str]) -> ModelConfig:
        """Apply typed `key=value` overrides from the command line."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        hints = typing.get_type_hints(ModelConfig)
        kwargs = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in fields:
                raise UserError(
                    f"model override {pair!r} is not KEY=VALUE with a known key; keys: "
                    f"{', '.join(fields)}"
                )
            kwargs[key] = _parse_value(key, value, hints[key])
        return self.replace(**kwargs)


@functools.cache
def field_kinds() -> dict[str, tuple[type, bool]]:
    """Each ModelConfig field's type (int, float, bool or str) and whether it may be None."""
    hints = typing.get_type_hints(ModelConfig)
    out = {}
    for f in dataclasses.fields(ModelConfig):
        args = typing.get_args(hints[f.name])
        out[f.name] = (next((a for a in args if a is not type(None)), hints[f.name]),
                       type(None) in args)
    return out


def _check_range(name: str, kind: type, value) -> None:
    """Sizes in 1..their cap (`SIZE_CAPS`), scales positive and finite; None passes."""
    if value is None or isinstance(value, bool) or kind not in (int, float):
        return
    if kind is int:
        cap = SIZE_CAPS.get(name, SIZE_CAP)
        if value < 1:
            raise UserError(f"model {name}={value} must be positive")
        if value > cap:
            raise UserError(f"model {name}={value:,} is more than {cap:,}, a sanity cap; "
                            "check the value")
    elif name in NONNEGATIVE:
        if not (math.isfinite(value) and value >= 0):
            raise UserError(f"model {name}={value} must be a finite number >= 0")
    elif not (math.isfinite(value) and value > 0):
        raise UserError(f"model {name}={value} must be a positive finite number")


def _parse_value(key: str, value: str, hint) -> object:
    args = typing.get_args(hint)
    if value.lower() == "none" and type(None) in args:
        return None
    base = next((a for a in args if a is not type(None)), hint)
    try:
        if base is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return base(value)
    except ValueError:
        raise UserError(f"model override {key}={value!r} is not a valid {base.__name__}") from None
