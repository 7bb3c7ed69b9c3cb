"""Shared transformer blocks (Flax NNX). Parameters carry logical axis names, never mesh axes."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from oases_jax import compat, step_order
from oases_jax import projections as proj
from oases_jax.compat import varying_axes
from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig
from oases_jax.models.pointwise import gelu, layer_norm, rms_norm, swiglu
from oases_jax.rules import active_rules, constrain, spec_divides, suspend_rules
from oases_jax.stacks import LayerFns
from oases_jax.targets import cudnn_missing

# Activations are tagged with the names of `oases_jax.remat` (SAVE_NAMES, COLUMN_OUT_NAMES), so
# its policies can keep the values on both sides of every tensor-parallel collective.


def param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    *,
    std: float | None,
    value: float = 0.0,
) -> nnx.Param:
    """A float32 parameter annotated with logical axis names (normal(std), or constant `value`)."""
    assert len(shape) == len(names), (shape, names)
    if std is None:
        array = jnp.full(shape, value, jnp.float32)
    else:
        array = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(array, out_sharding=names, eager_sharding=False)


def _cast(p: nnx.Param, dtype) -> jax.Array:
    return p[...].astype(dtype)


# Weights that keep their float32 values where they are used (the MoE router computes its
# logits in float32, `oases_jax.moe.routing.route`).
FLOAT32_WEIGHTS = ("router",)


def compute_weights(layers, dtype, lead: int = 1):
    """The layers' weight matrices cast to the compute dtype once per step, before the layer
    loop, rather than at every use inside it (forward, recompute): one pass over the float32
    weights instead of two, the layer loop then slices bf16 weights (half the bytes), and FSDP
    gathers them in bf16. `lead` is the number of stacking axes (1 for the model's stacked
    layers, 0 for one block). Vectors (biases, norm scales) and FLOAT32_WEIGHTS stay as they
    are: the norms compute in float32 and a bias is cast where it is added. The values are the
    same as a cast at each use; each weight's gradient reaches its float32 parameter through the
    one cast."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return layers

    def cast(path, a):
        names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
        if (jnp.issubdtype(a.dtype, jnp.floating) and a.ndim - lead >= 2
                and a.dtype.itemsize > dtype.itemsize and not names & set(FLOAT32_WEIGHTS)):
            return a.astype(dtype)
        return a

    return jax.tree_util.tree_map_with_path(cast, layers)


class LayerNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = param(rngs, (cfg.d_model,), ("norm",), std=None, value=1.0)
        self.bias = param(rngs, (cfg.d_model,), ("norm",), std=None, value=0.0)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        return layer_norm(x_BLD, self.scale[...], self.bias[...], self.eps)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = param(rngs, (cfg.d_model,), ("norm",), std=None, value=1.0)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        return rms_norm(x_BLD, self.scale[...], self.eps)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """RoPE's K/2 inverse frequencies f_i = theta^(-2i/K). Under Llama-3 scaling (factor s,
    frequency factors l < h, original context C) a frequency of wavelength w = 2 pi / f above C/l
    becomes f/s, one below C/h stays f, and one between blends them: (1 - a) f/s + a f with
    a = (C/w - l) / (h - l) (transformers' `_compute_llama3_parameters`)."""
    k, s = cfg.k_dim, cfg.rope_scaling_factor
    inv_freq = cfg.rope_theta ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)
    if s == 1.0:
        return inv_freq
    lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    blend = jnp.clip((cfg.rope_original_max_len / wavelength - lo) / (hi - lo), 0.0, 1.0)
    return (1 - blend) * inv_freq / s + blend * inv_freq


@jax.named_scope("rope")
def rope(x_BLHK: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, half-split convention (the Hugging Face LLaMA layout), at the
    `rope_frequencies` of the model."""
    _, length, _, k = x_BLHK.shape
    angles_LK = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles_LK = jnp.concatenate([angles_LK, angles_LK], axis=-1)
    cos, sin = jnp.cos(angles_LK)[:, None, :], jnp.sin(angles_LK)[:, None, :]
    x = x_BLHK.astype(jnp.float32)
    x1, x2 = x[..., : k // 2], x[..., k // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_BLHK.dtype)


def _traced_platform() -> str:
    """The platform of the devices the program being traced is for: the active rules' mesh
    (`use_rules`), else jax's abstract mesh (under `jax.set_mesh`, or inside a shard_map whose
    rules are suspended), else the default backend. Deviceless GPU devices report "gpu" too."""
    active = active_rules()
    if active is not None and isinstance(active[1], jax.sharding.Mesh):
        return active[1].devices.flat[0].platform
    mesh = active[1] if active is not None else jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def attention_impl(cfg: ModelConfig) -> str:
    """The kernel `cfg.attention` resolves to for the devices being traced for
    (`ModelConfig.flash_attention`): cuDNN's fused kernel on a GPU mesh, real or deviceless, xla
    elsewhere. A deviceless compile needs NVIDIA's cuDNN wheel for jax's trace-time version check;
    without it `auto` falls back to xla with a warning."""
    platform = _traced_platform()
    on_gpu = platform == "gpu"
    if cfg.attention == "cudnn" and not (on_gpu and cfg.fused_attention_fits):
        raise UserError(
            f"attention=cudnn needs a GPU backend (the mesh's devices are {platform}) and bf16 "
            f"compute with head_dim a multiple of 8 up to 128 (got {cfg.dtype}, {cfg.k_dim}); "
            "use --model-set attention=auto or attention=xla")
    if not cfg.flash_attention(on_gpu=on_gpu):
        return "xla"
    missing = cudnn_missing()
    if missing is None:
        return "cudnn"
    if cfg.attention == "cudnn":
        raise UserError(f"attention=cudnn cannot be traced: {missing}")
    warnings.warn(f"attention=auto uses xla (materialised scores), not cuDNN's fused kernel, for "
                  f"this GPU program: {missing}", stacklevel=2)
    return "xla"


@jax.named_scope("attention")
def _cudnn_attention(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array) -> jax.Array:
    """cuDNN's causal fused attention. Inside an enclosing `shard_map` (accumulation over data
    groups, a pipeline's stage loop) the kernel runs in a `shard_map` of its own over the axes
    left to the partitioner: jax's partitioning rule for it reads `.spec` of a sharding with
    manual axes and fails the compile (jax 0.12, any GPU target)."""
    def call(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    active = active_rules()
    if active is None or not compat.manual_axes():
        return call(q_BLHK, k_BLGK, v_BLGK)
    rules, mesh = active  # the specs leave the enclosing shard_map's axes out (`outer_axes`)
    q_spec = rules.act_spec(("batch", None, "heads", "head_dim"), mesh)
    kv_spec = rules.act_spec(("batch", None, "kv_heads", "head_dim"), mesh)
    if spec_divides(q_BLHK.shape, q_spec, mesh) is not None \
            or spec_divides(k_BLGK.shape, kv_spec, mesh) is not None:
        q_spec = kv_spec = jax.sharding.PartitionSpec()  # whole on every device of the group
    with suspend_rules():
        return jax.shard_map(call, mesh=compat.context_mesh(mesh),
                             in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             check_vma=False)(q_BLHK, k_BLGK, v_BLGK)


@jax.named_scope("attention")
def _xla_attention(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array) -> jax.Array:
    """Causal attention with the scores materialised in float32."""
    b, length, h, k = q_BLHK.shape
    g = k_BLGK.shape[2]
    q_BLGRK = q_BLHK.reshape(b, length, g, h // g, k)
    scores = jnp.einsum(
        "blgrk,bmgk->bgrlm", q_BLGRK, k_BLGK, preferred_element_type=jnp.float32
    )
    scores = scores / math.sqrt(k)
    causal_LM = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal_LM, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BLHK.dtype)
    o_BLGRK = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BLGK)
    return o_BLGRK.reshape(b, length, h, k)


class Attention(nnx.Module):
    """Causal self-attention with grouped-query heads (G KV heads shared by H/G query heads)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, g, k = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k_dim
        std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
        self.cfg = cfg
        self.wq = param(rngs, (d, h, k), ("embed", "heads", "head_dim"), std=std)
        self.wk = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std=std)
        self.wv = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std=std)
        self.wo = param(rngs, (h, k, d), ("heads", "head_dim", "embed"), std=out_std)
        if cfg.use_bias:
            self.bq = param(rngs, (h, k), ("heads", "head_dim"), std=None)
            self.bk = param(rngs, (g, k), ("kv_heads", "head_dim"), std=None)
            self.bv = param(rngs, (g, k), ("kv_heads", "head_dim"), std=None)
            self.bo = param(rngs, (d,), ("embed",), std=None)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, x_BLD.dtype
        x_BLD = checkpoint_name(x_BLD, "attn_in")
        q_BLHK, k_BLGK, v_BLGK = proj.column(
            x_BLD, [_cast(self.wq, dt), _cast(self.wk, dt), _cast(self.wv, dt)],
            [("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim"),
             ("embed", "kv_heads", "head_dim")])
        if cfg.use_bias:  # add_bias: the output may be in a schedule's own layout (primepar)
            q_BLHK = proj.add_bias(q_BLHK, _cast(self.bq, dt), ("heads", "head_dim"))
            k_BLGK = proj.add_bias(k_BLGK, _cast(self.bk, dt), ("kv_heads", "head_dim"))
            v_BLGK = proj.add_bias(v_BLGK, _cast(self.bv, dt), ("kv_heads", "head_dim"))
        q_BLHK, k_BLGK, v_BLGK = (checkpoint_name(t, "attn_qkv") for t in (q_BLHK, k_BLGK, v_BLGK))
        if not cfg.learned_positions:
            inv_freq = rope_frequencies(cfg)
            q_BLHK, k_BLGK = rope(q_BLHK, inv_freq), rope(k_BLGK, inv_freq)
        q_BLHK = constrain(q_BLHK, ("batch", None, "heads", "head_dim"))
        k_BLGK = constrain(k_BLGK, ("batch", None, "kv_heads", "head_dim"))
        v_BLGK = constrain(v_BLGK, ("batch", None, "kv_heads", "head_dim"))
        if attention_impl(cfg) == "cudnn":
            o_BLHK = _cudnn_attention(q_BLHK, k_BLGK, v_BLGK)
        else:
            o_BLHK = _xla_attention(q_BLHK, k_BLGK, v_BLGK)
        out_BLD = proj.row(o_BLHK, _cast(self.wo, dt), ("heads", "head_dim", "embed"))
        if cfg.use_bias:
            with jax.named_scope("bias"):
                out_BLD += _cast(self.bo, dt)
        return checkpoint_name(out_BLD, "attn_out")


class MLP(nnx.Module):
    """GELU (tanh form, as GPT-2) or SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.ff_dim
        self.cfg = cfg
        self.w_in = param(rngs, (d, f), ("embed", "mlp"), std=0.02)
        if cfg.gated_mlp:
            self.w_gate = param(rngs, (d, f), ("embed", "mlp"), std=0.02)
        self.w_out = param(rngs, (f, d), ("mlp", "embed"), std=0.02 / math.sqrt(2 * cfg.n_layers))
        if cfg.use_bias:
            self.b_in = param(rngs, (f,), ("mlp",), std=None)
            self.b_out = param(rngs, (d,), ("embed",), std=None)

    def _hidden(self, x_BLD: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, x_BLD.dtype
        x_BLD = checkpoint_name(x_BLD, "mlp_in")
        weights = [_cast(self.w_in, dt)] + ([_cast(self.w_gate, dt)] if cfg.gated_mlp else [])
        h_BLF, *gate = proj.column(x_BLD, weights, [("embed", "mlp")] * len(weights))
        h_BLF, *gate = (checkpoint_name(t, "mlp_hidden") for t in (h_BLF, *gate))
        if cfg.use_bias:
            h_BLF = proj.add_bias(h_BLF, _cast(self.b_in, dt), ("mlp",))
        h_BLF = swiglu(gate[0], h_BLF) if cfg.gated_mlp else gelu(h_BLF)
        return constrain(h_BLF, ("batch", None, "mlp"))

    def _bias_out(self, dt) -> jax.Array | None:
        return _cast(self.b_out, dt) if self.cfg.use_bias else None

    @staticmethod
    def _finish(out_BLD: jax.Array, bias: jax.Array | None) -> jax.Array:
        if bias is not None:
            with jax.named_scope("bias"):
                out_BLD += bias
        return checkpoint_name(out_BLD, "mlp_out")

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        out_BLD = proj.row(self._hidden(x_BLD), _cast(self.w_out, x_BLD.dtype),
                                  ("mlp", "embed"))
        return self._finish(out_BLD, self._bias_out(x_BLD.dtype))

    def deferred(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The MLP up to its row projection's collective, as (partial sum, output bias) for
        `complete` (an overlapped stack completes it in the next layer)."""
        partial = proj.row_partial(self._hidden(x_BLD), _cast(self.w_out, x_BLD.dtype))
        return partial, self._bias_out(x_BLD.dtype)

    @staticmethod
    def complete(pending: tuple[jax.Array, jax.Array | None]) -> jax.Array:
        """The MLP's output from `deferred`'s state: all-reduce, bias, named for remat."""
        partial, bias = pending
        return MLP._finish(proj.complete(partial), bias)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). How the two steps are
    ordered and split (sub-batches, shard_map) is the runtime's business (`oases_jax.stacks`),
    which runs blocks through `block_fns`."""

    def __init__(self, cfg: ModelConfig, norm_cls: type[nnx.Module], *, rngs: nnx.Rngs):
        self.norm1 = norm_cls(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm2 = norm_cls(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def ops(self) -> dict[str, Callable[[jax.Array], jax.Array]]:
        return {"attn": lambda x: self.attn(self.norm1(x)),
                "mlp": lambda x: self.mlp(self.norm2(x))}

    def deferred(self, x_BLD: jax.Array):
        """The last step of a layer (its MLP) up to its collective (`MLP.deferred`)."""
        return self.mlp.deferred(self.norm2(x_BLD))

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        return step_order.run(step_order.sequential(), x_BLD, self.ops(),
                              constrain=lambda x: constrain(x, ("batch", "seq", "embed")))


def _names(v: nnx.Variable) -> tuple:
    """A variable's logical names for its value's dims (a stacked `layers` name dropped)."""
    names = tuple(v.get_metadata().get("out_sharding") or ())
    return names[len(names) - v.get_value().ndim:]


def block_fns(graphdef: nnx.GraphDef) -> LayerFns:
    """Blocks of `graphdef` as the pure functions of their state the runtime runs."""
    merge = lambda state: nnx.merge(graphdef, state)  # noqa: E731

    def zero_pending(partial0, state):
        # The zero bias varies over the mesh axes the real one does (a layer-wide shard_map
        # types it so), without depending on its value: `b * 0` would add a gradient path into
        # the first layer's bias, which cost the oases step a quarter of its overlap on h100:8.
        if "b_out" not in state["mlp"]:
            return partial0, None
        b = jax.tree.leaves(state["mlp"]["b_out"])[0]
        zero = jnp.zeros(partial0.shape[-1:], partial0.dtype)
        axes = tuple(sorted(varying_axes(b)))
        return partial0, (jax.lax.pcast(zero, axes, to="varying") if axes else zero)

    return LayerFns(
        ops=lambda state: merge(state).ops(),
        defer=lambda state: merge(state).deferred,
        complete=MLP.complete,
        zero_pending=zero_pending,
        state_names=lambda state: jax.tree.map(
            _names, state, is_leaf=lambda v: isinstance(v, nnx.Variable)),
    )
