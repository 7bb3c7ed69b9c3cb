"""Mixture-of-experts blocks (Flax NNX): the MoE feed-forward (E experts, each the family's MLP,
a top-k router), the MoE block, and the layer group the stack scans over: moe_every - 1 dense
blocks followed by one MoE block (docs/parallelism.md, "Mixture of experts")."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from oases_jax import moe as moe_rt
from oases_jax import step_order
from oases_jax.models.config import ModelConfig
from oases_jax.models.layers import Attention, Block, _names, gelu, param, swiglu
from oases_jax.moe.stack import GroupFns

LOSSES = ("aux_loss", "z_loss", "dropped_frac")


def expert_ffn(w: dict, buf_END: jax.Array) -> jax.Array:
    """The local experts' MLP on their slots [E_l, N, D], up to the sum over the MP shards of
    F (the output bias is added after it)."""
    h = jnp.einsum("end,edf->enf", buf_END, w["w_in"])
    if "b_in" in w:
        h = h + w["b_in"][:, None, :]
    if "w_gate" in w:
        h = swiglu(jnp.einsum("end,edf->enf", buf_END, w["w_gate"]), h)
    else:
        h = gelu(h)
    return jnp.einsum("enf,efd->end", h, w["w_out"])


class MoEFFN(nnx.Module):
    """E experts of the family's MLP and a router; `__call__` returns (y, router losses)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.expert_ff_dim, cfg.n_experts
        self.cfg = cfg
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.router = param(rngs, (d, e), ("embed", None), std=0.02)
        self.w_in = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std=0.02)
        if cfg.gated_mlp:
            self.w_gate = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std=0.02)
        self.w_out = param(rngs, (e, f, d), ("expert", "mlp", "embed"), std=out_std)
        if cfg.use_bias:
            self.b_in = param(rngs, (e, f), ("expert", "mlp"), std=None)
            self.b_out = param(rngs, (e, d), ("expert", "embed"), std=None)

    def __call__(self, x_BLD: jax.Array) -> tuple[jax.Array, dict]:
        cfg, dt = self.cfg, x_BLD.dtype
        keys = ["w_in", "w_out"] + (["w_gate"] if cfg.gated_mlp else []) + (
            ["b_in"] if cfg.use_bias else [])
        weights = {k: getattr(self, k)[...].astype(dt) for k in keys}
        names = {k: _names(getattr(self, k)) for k in keys}
        bias = self.b_out[...].astype(dt) if cfg.use_bias else None
        args = moe_rt.MoEArgs(top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                              norm_topk=cfg.router_norm_topk)
        return moe_rt.moe_layer(x_BLD, self.router[...], weights, expert_fn=expert_ffn,
                                bias_ED=bias, names=names, args=args, gated=cfg.gated_mlp)


class MoEBlock(nnx.Module):
    """Pre-norm residual block whose MLP is an MoE feed-forward."""

    def __init__(self, cfg: ModelConfig, norm_cls: type[nnx.Module], *, rngs: nnx.Rngs):
        self.norm1 = norm_cls(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm2 = norm_cls(cfg, rngs=rngs)
        self.moe = MoEFFN(cfg, rngs=rngs)

    def run(self, x_BLD, constrain: Callable) -> tuple[jax.Array, dict]:
        x_BLD = constrain(x_BLD + self.attn(self.norm1(x_BLD)))
        y_BLD, losses = self.moe(self.norm2(x_BLD))
        return constrain(x_BLD + y_BLD.astype(x_BLD.dtype)), losses


class MoEGroup(nnx.Module):
    """moe_every - 1 dense blocks, then one MoE block: the unit the layer stack scans over, so
    that every scanned step has the same structure."""

    def __init__(self, cfg: ModelConfig, norm_cls: type[nnx.Module], *, rngs: nnx.Rngs):
        self.n_dense = cfg.moe_every - 1
        for i in range(self.n_dense):
            setattr(self, f"dense{i}", Block(cfg, norm_cls, rngs=rngs))
        self.moe_block = MoEBlock(cfg, norm_cls, rngs=rngs)

    def run(self, x_BLD, constrain: Callable) -> tuple[jax.Array, dict]:
        for i in range(self.n_dense):
            x_BLD = step_order.run(step_order.sequential(), x_BLD,
                                   getattr(self, f"dense{i}").ops(), constrain=constrain)
        return self.moe_block.run(x_BLD, constrain)


def group_fns(graphdef: nnx.GraphDef) -> GroupFns:
    """Layer groups of `graphdef` as the pure function of their state the runtime runs."""
    return GroupFns(run=lambda state, x, constrain: nnx.merge(graphdef, state).run(x, constrain),
                    losses=LOSSES)
