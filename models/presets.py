"""Named model presets, from `tiny` (tests) to the full-size shapes the published systems used.

Full-size presets are for planning and compiling only (abstract shapes); never materialise them
on a CPU. OPT and BLOOM are built as the GPT-2 family: their activation (ReLU) and position
scheme (ALiBi) do not change the shapes, FLOPs or communication that planning depends on.
"""

from __future__ import annotations

from collections.abc import Callable

from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig

GPT2_VOCAB = 50257


def tiny() -> ModelConfig:
    """Two-layer GPT-2 for tests; every width splits 8 ways.
    `python scripts/train.py --model tiny --steps 50`"""
    return ModelConfig(family="gpt2", d_model=64, n_layers=2, n_heads=8, d_ff=256, max_seq_len=128)


def tiny_llama() -> ModelConfig:
    """Two-layer LLaMA with grouped-query attention (16 heads, 8 KV heads) for tests.
    `python scripts/train.py --model tiny-llama --steps 50`"""
    return ModelConfig(
        family="llama",
        d_model=64,
        n_layers=2,
        n_heads=16,
        n_kv_heads=8,
        head_dim=8,
        d_ff=256,
        max_seq_len=128,
    )


def small() -> ModelConfig:
    """The quickstart model: 4-layer GPT-2, width 256, 8 heads, MLP 1024, byte vocabulary.
    `python scripts/train.py`"""
    return ModelConfig(
        family="gpt2", d_model=256, n_layers=4, n_heads=8, d_ff=1024, max_seq_len=256
    )


def small_llama() -> ModelConfig:
    """A LLaMA-style model of the `small` size (8 heads, 8 KV heads, SwiGLU 768).
    `python scripts/train.py --model small-llama`"""
    return ModelConfig(
        family="llama", d_model=256, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=768, max_seq_len=256
    )


def _gpt(layers: int, hidden: int, heads: int, seq: int = 1024, vocab: int = GPT2_VOCAB):
    return ModelConfig(
        family="gpt2",
        vocab_size=vocab,
        d_model=hidden,
        n_layers=layers,
        n_heads=heads,
        max_seq_len=seq,
    )


def gpt2_1_5b() -> ModelConfig:
    """GPT-2 1.5B (48 layers, hidden 1600, 25 heads).
    `python scripts/plan.py --model gpt2-1.5b --cluster h100-8`"""
    return _gpt(48, 1600, 25)


def gpt_2_5b() -> ModelConfig:
    """Megatron GPT 2.5B (54 layers, hidden 1920, 20 heads).
    `python scripts/plan.py --model gpt-2.5b --cluster v100-32`"""
    return _gpt(54, 1920, 20)


def gpt_8_3b() -> ModelConfig:
    """Megatron GPT 8.3B (72 layers, hidden 3072, 24 heads).
    `python scripts/plan.py --model gpt-8.3b --cluster v100-32`"""
    return _gpt(72, 3072, 24)


def gpt_20b() -> ModelConfig:
    """20B-class GPT (44 layers, hidden 6144, 64 heads).
    `python scripts/plan.py --model gpt-20b --cluster h100-32`"""
    return _gpt(44, 6144, 64)


def _oases(hidden: int, layers: int) -> Callable[[], ModelConfig]:
    def preset() -> ModelConfig:
        return _gpt(layers, hidden, hidden // 64)

    preset.__doc__ = (
        f"Oases benchmark GPT: hidden {hidden}, {layers} layers, {hidden // 64} heads, seq 1024.\n"
        f"    `python scripts/plan.py --model oases-h{hidden}-l{layers} --cluster 3090-nvlink-32`"
    )
    return preset


def opt_6_7b() -> ModelConfig:
    """OPT-6.7B shapes (32 layers, hidden 4096, 32 heads, seq 2048).
    `python scripts/plan.py --model opt-6.7b --cluster h100-8`"""
    return _gpt(32, 4096, 32, seq=2048, vocab=50272)


def opt_175b() -> ModelConfig:
    """OPT-175B shapes (96 layers, hidden 12288, 96 heads, seq 2048).
    `python scripts/plan.py --model opt-175b --cluster h100-32`"""
    return _gpt(96, 12288, 96, seq=2048, vocab=50272)


def llama2_7b() -> ModelConfig:
    """Llama 2 7B (32 layers, hidden 4096, 32 heads, MLP 11008, seq 4096).
    `python scripts/plan.py --model llama2-7b --cluster h100-8`"""
    return ModelConfig(
        family="llama",
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        d_ff=11008,
        max_seq_len=4096,
        norm_eps=1e-5,
    )


def llama2_70b() -> ModelConfig:
    """Llama 2 70B (80 layers, hidden 8192, 64 heads, 8 KV heads, MLP 28672, seq 4096).
    `python scripts/plan.py --model llama2-70b --cluster h100-32`"""
    return ModelConfig(
        family="llama",
        vocab_size=32000,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=28672,
        max_seq_len=4096,
        norm_eps=1e-5,
    )


def bloom_7b1() -> ModelConfig:
    """BLOOM-7B1 shapes (30 layers, hidden 4096, 32 heads, vocab 250880, seq 2048).
    `python scripts/plan.py --model bloom-7b1 --cluster h100-8`"""
    return _gpt(30, 4096, 32, seq=2048, vocab=250880)


def bloom_176b() -> ModelConfig:
    """BLOOM-176B shapes (70 layers, hidden 14336, 112 heads, vocab 250880, seq 2048).
    `python scripts/plan.py --model bloom-176b --cluster h100-32`"""
    return _gpt(70, 14336, 112, seq=2048, vocab=250880)


def tiny_moe() -> ModelConfig:
    """`tiny` with its second layer an MoE of 4 experts, top-2 (tests).
    `python scripts/train.py --model tiny-moe --mesh expert=2,tensor=4 --steps 50`"""
    return tiny().replace(n_experts=4, top_k=2, moe_every=2, capacity_factor=2.0)


def small_moe() -> ModelConfig:
    """`small` with every other MLP an MoE of 8 experts (width 1024), top-2, capacity factor
    1.25 (the MoE quickstart).
    `python scripts/train.py --model small-moe --mesh data=2,expert=2,tensor=2`"""
    return small().replace(n_experts=8, top_k=2, moe_every=2, capacity_factor=1.25)


def _gpt2_moe(hidden: int, experts: int) -> Callable[[], ModelConfig]:
    def preset() -> ModelConfig:
        return _gpt(12, hidden, hidden // 64).replace(n_experts=experts, top_k=2, moe_every=2,
                                                      capacity_factor=1.25)

    preset.__doc__ = (
        f"GPT-2-based MoE (Parm, WORKLOADS.md): 12 layers, hidden {hidden}, every other MLP "
        f"{experts} experts, top-2 (override top_k=1, capacity_factor=1.0 or 2.0).\n"
        f"    `python scripts/inspect_hlo.py --model gpt2-moe-h{hidden}-e{experts} --target h100:8 "
        "--mesh expert=2,tensor=4`")
    return preset


def mixtral_8x7b() -> ModelConfig:
    """Mixtral 8x7B shapes (32 layers, hidden 4096, 32 heads, 8 KV heads, 8 experts of SwiGLU
    14336, top-2 renormalised; planning and compiling only).
    `python scripts/inspect_hlo.py --model mixtral-8x7b --target h100:8 --mesh expert=8`"""
    return ModelConfig(family="llama", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                       n_kv_heads=8, head_dim=128, d_ff=14336, max_seq_len=4096,
                       rope_theta=1e6, n_experts=8, top_k=2, router_norm_topk=True,
                       router_aux_weight=0.02, capacity_factor=1.25)


def olmoe_1b_7b() -> ModelConfig:
    """OLMoE-1B-7B shapes (16 layers, hidden 2048, 16 heads, 64 experts of SwiGLU 1024, top-8,
    gates not renormalised; planning and compiling only).
    `python scripts/inspect_hlo.py --model olmoe-1b-7b --target h100:8 --mesh expert=8`"""
    return ModelConfig(family="llama", vocab_size=50304, d_model=2048, n_layers=16, n_heads=16,
                       d_ff=1024, max_seq_len=4096, n_experts=64, top_k=8,
                       router_aux_weight=0.01, router_z_weight=0.001, capacity_factor=1.25)


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B shapes (48 layers, hidden 2048, 32 heads, 4 KV heads of 128, 128 experts of
    SwiGLU 768, top-8 renormalised; planning and compiling only).
    `python scripts/inspect_hlo.py --model qwen3-30b-a3b --target h100:8 --mesh expert=8`"""
    return ModelConfig(family="llama", vocab_size=151936, d_model=2048, n_layers=48,
                       n_heads=32, n_kv_heads=4, head_dim=128, d_ff=768, max_seq_len=4096,
                       rope_theta=1e6, n_experts=128, top_k=8, router_norm_topk=True,
                       router_aux_weight=0.001, capacity_factor=1.25)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "tiny-llama": tiny_llama,
    "small": small,
    "small-llama": small_llama,
    "gpt2-1.5b": gpt2_1_5b,
    "gpt-2.5b": gpt_2_5b,
    "gpt-8.3b": gpt_8_3b,
    "gpt-20b": gpt_20b,
    **{
        f"oases-h{h}-l{n}": _oases(h, n)
        for h, n in (
            (1024, 24),
            (2048, 24),
            (3072, 24),
            (4096, 16),
            (6144, 16),
            (8192, 8),
            (12288, 4),
        )
    },
    "opt-6.7b": opt_6_7b,
    "opt-175b": opt_175b,
    "llama2-7b": llama2_7b,
    "llama2-70b": llama2_70b,
    "bloom-7b1": bloom_7b1,
    "bloom-176b": bloom_176b,
    "tiny-moe": tiny_moe,
    "small-moe": small_moe,
    **{f"gpt2-moe-h{h}-e{e}": _gpt2_moe(h, e) for h in (768, 1024, 2048) for e in (8, 16, 32)},
    "mixtral-8x7b": mixtral_8x7b,
    "olmoe-1b-7b": olmoe_1b_7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}

# Presets small enough to build on a CPU.
CPU_PRESETS = ("tiny", "tiny-llama", "small", "small-llama", "tiny-moe", "small-moe")


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
