"""Shared transformer blocks (Flax NNX). Parameters carry logical axis names, never mesh axes."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from oases_jax import schedules
from oases_jax import tensor_parallel as tp
from oases_jax.errors import UserError
from oases_jax.rules import constrain

# Names of the activations a remat policy may save (see `models.transformer.remat_policy`).
# `*_in` are the normalised inputs of the column-parallel projections (after any all-gather),
# `*_out` the outputs of the row-parallel ones (after the all-reduce / reduce-scatter): saving
# them makes recomputation free of tensor-parallel communication.
SAVE_NAMES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
# Under ring schedules the gather happens inside the column-parallel projection, so its outputs
# are the post-collective values to keep.
RING_SAVE_NAMES = ("attn_qkv", "mlp_hidden")


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


class LayerNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = param(rngs, (cfg.d_model,), ("norm",), std=None, value=1.0)
        self.bias = param(rngs, (cfg.d_model,), ("norm",), std=None, value=0.0)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        x = x_BLD.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]
        return y.astype(x_BLD.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = param(rngs, (cfg.d_model,), ("norm",), std=None, value=1.0)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        x = x_BLD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps) * self.scale[...]
        return y.astype(x_BLD.dtype)


def rope(x_BLHK: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split convention (the Hugging Face LLaMA layout)."""
    _, length, _, k = x_BLHK.shape
    inv_freq = theta ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)
    angles_LK = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles_LK = jnp.concatenate([angles_LK, angles_LK], axis=-1)
    cos, sin = jnp.cos(angles_LK)[:, None, :], jnp.sin(angles_LK)[:, None, :]
    x = x_BLHK.astype(jnp.float32)
    x1, x2 = x[..., : k // 2], x[..., k // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_BLHK.dtype)


def attention_impl(cfg: ModelConfig) -> str:
    """The kernel `cfg.attention` resolves to on the backend at hand
    (`ModelConfig.flash_attention`). cuDNN's kernel needs the library at trace time, so
    compiles for GPU targets without a GPU use xla."""
    on_gpu = jax.default_backend() == "gpu"
    if cfg.attention == "cudnn" and not (on_gpu and cfg.fused_attention_fits):
        raise UserError(
            f"attention=cudnn needs a GPU backend (found {jax.default_backend()}) and bf16 "
            f"compute with head_dim a multiple of 8 up to 128 (got {cfg.dtype}, {cfg.k_dim}); "
            "use --model-set attention=auto or attention=xla")
    return "cudnn" if cfg.flash_attention(on_gpu=on_gpu) else "xla"


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
        q_BLHK, k_BLGK, v_BLGK = tp.column_parallel(
            x_BLD, [_cast(self.wq, dt), _cast(self.wk, dt), _cast(self.wv, dt)],
            [("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim"),
             ("embed", "kv_heads", "head_dim")])
        if cfg.use_bias:  # add_bias: the output may be in a schedule's own layout (primepar)
            q_BLHK = tp.add_bias(q_BLHK, _cast(self.bq, dt), ("heads", "head_dim"))
            k_BLGK = tp.add_bias(k_BLGK, _cast(self.bk, dt), ("kv_heads", "head_dim"))
            v_BLGK = tp.add_bias(v_BLGK, _cast(self.bv, dt), ("kv_heads", "head_dim"))
        q_BLHK, k_BLGK, v_BLGK = (checkpoint_name(t, "attn_qkv") for t in (q_BLHK, k_BLGK, v_BLGK))
        if not cfg.learned_positions:
            q_BLHK, k_BLGK = rope(q_BLHK, cfg.rope_theta), rope(k_BLGK, cfg.rope_theta)
        q_BLHK = constrain(q_BLHK, ("batch", None, "heads", "head_dim"))
        k_BLGK = constrain(k_BLGK, ("batch", None, "kv_heads", "head_dim"))
        v_BLGK = constrain(v_BLGK, ("batch", None, "kv_heads", "head_dim"))
        if attention_impl(cfg) == "cudnn":
            o_BLHK = jax.nn.dot_product_attention(
                q_BLHK, k_BLGK, v_BLGK, is_causal=True, implementation="cudnn")
        else:
            o_BLHK = _xla_attention(q_BLHK, k_BLGK, v_BLGK)
        out_BLD = tp.row_parallel(o_BLHK, _cast(self.wo, dt), ("heads", "head_dim", "embed"))
        if cfg.use_bias:
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
        h_BLF, *gate = tp.column_parallel(x_BLD, weights, [("embed", "mlp")] * len(weights))
        h_BLF, *gate = (checkpoint_name(t, "mlp_hidden") for t in (h_BLF, *gate))
        if cfg.use_bias:
            h_BLF = tp.add_bias(h_BLF, _cast(self.b_in, dt), ("mlp",))
        if cfg.gated_mlp:
            h_BLF = jax.nn.silu(gate[0]) * h_BLF
        else:
            h_BLF = jax.nn.gelu(h_BLF, approximate=True)
        return constrain(h_BLF, ("batch", None, "mlp"))

    def _bias_out(self, dt) -> jax.Array | None:
        return _cast(self.b_out, dt) if self.cfg.use_bias else None

    @staticmethod
    def _finish(out_BLD: jax.Array, bias: jax.Array | None) -> jax.Array:
        if bias is not None:
            out_BLD += bias
        return checkpoint_name(out_BLD, "mlp_out")

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        out_BLD = tp.row_parallel(self._hidden(x_BLD), _cast(self.w_out, x_BLD.dtype),
                                  ("mlp", "embed"))
        return self._finish(out_BLD, self._bias_out(x_BLD.dtype))

    def deferred(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Inside a manual region: the MLP up to its all-reduce, as (partial sum, output bias)
        for `complete` (a pipelined stack completes it in the next layer)."""
        partial = tp.row_partial(self._hidden(x_BLD), _cast(self.w_out, x_BLD.dtype))
        return partial, self._bias_out(x_BLD.dtype)

    @staticmethod
    def complete(pending: tuple[jax.Array, jax.Array | None]) -> jax.Array:
        """The MLP's output from `deferred`'s state: all-reduce, bias, named for remat."""
        partial, bias = pending
        return MLP._finish(tp.complete_partial(partial), bias)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, norm_cls: type[nnx.Module], *, rngs: nnx.Rngs):
        self.norm1 = norm_cls(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm2 = norm_cls(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def _ops(self):
        return {"attn": lambda x: self.attn(self.norm1(x)),
                "mlp": lambda x: self.mlp(self.norm2(x))}

    def _deferred(self, x_BLD: jax.Array):
        """The last step of the Oases schedule (an MLP) up to its all-reduce (`MLP.deferred`)."""
        return self.mlp.deferred(self.norm2(x_BLD))

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        # The order of work (one pass, or Oases sub-batches) comes from the active schedule.
        ctx = tp.active()
        if ctx is not None and ctx.manual_layer:
            return _manual_layer(self, x_BLD, ctx)
        return schedules.run(tp.layer_schedule(), x_BLD, self._ops(),
                             constrain=lambda x: constrain(x, ("batch", "seq", "embed")))


def _local_specs(state, ctx: tp.TensorParallel, stacked: bool = False):
    """Per-variable PartitionSpecs of a block's state (`stacked`: with a leading layers axis,
    unsharded) for the layer's shard_map."""
    lead = (None,) if stacked else ()

    def spec(v: nnx.Variable):
        names = tuple(v.get_metadata().get("out_sharding") or ())
        ndim = v.get_value().ndim - len(lead)
        names = names[len(names) - ndim:]  # drop a stacked `layers` name
        return jax.P(*lead, *ctx.rules.param_spec(names, ctx.mesh))

    return jax.tree.map(spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _manual_layer(block: Block, x_BLD: jax.Array, ctx: tp.TensorParallel) -> jax.Array:
    """The whole layer inside one shard_map: per-device shapes, explicit collectives, and the
    sub-batch executor free to order one sub-batch's collective against another's compute."""
    graphdef, state = nnx.split(block)
    state_specs = _local_specs(state, ctx)
    x_spec = ctx.rules.act_spec(("batch", "seq", "embed"), ctx.mesh)

    def local(state, x):
        with tp.manual_region():
            ops = nnx.merge(graphdef, state)._ops()
            return schedules.run(ctx.layer_schedule, x, ops, before_step=tp.pin_order,
                                 after_step=tp.anchor)

    return jax.shard_map(local, mesh=ctx.mesh, in_specs=(state_specs, x_spec),
                         out_specs=x_spec)(state, x_BLD)


def _zero_pending(x_sub: jax.Array, layer_state, ctx: tp.TensorParallel):
    """`MLP.deferred`'s state with nothing in it: a zero partial sum, varying over the tensor
    axis like a real one (check_vma), and a zero output bias where the model has one."""
    partial = jax.lax.pcast(jnp.zeros_like(x_sub), (ctx.axis,), to="varying")
    has_bias = "b_out" in layer_state["mlp"]
    return partial, (jnp.zeros(x_sub.shape[-1:], x_sub.dtype) if has_bias else None)


def pipelined_layers(graphdef, stacked, x_BLD: jax.Array, ctx: tp.TensorParallel,
                     wrap: Callable[[Callable, bool], Callable], scan: bool) -> jax.Array:
    """A stack of Oases layers (`ctx.pipelined_stack`) in one shard_map, software-pipelined:
    the sub-batches stay split from the first layer to the last, and each layer leaves its last
    step's all-reduce (mlp of the last sub-batch) pending; the next layer issues it while its
    first sub-batch's attention computes (`schedules.run_pipelined`). The last one completes
    after the stack. `wrap(layer, in_scan)` applies the remat policy to one layer's function;
    `scan` runs the layers under one `lax.scan` (else a Python loop)."""
    schedule = ctx.layer_schedule
    x_spec = ctx.rules.act_spec(("batch", "seq", "embed"), ctx.mesh)

    def layer(carry, layer_state):
        xs, pending = carry
        with tp.manual_region():  # a fresh order-pinning state for each traced layer
            block = nnx.merge(graphdef, layer_state)
            carry = schedules.run_pipelined(
                schedule, xs, pending, block._ops(), block._deferred, MLP.complete,
                before_step=tp.pin_order, after_step=tp.anchor)
            tp.take_pending()
        return carry, None

    def local(stacked, x):
        n = jax.tree.leaves(stacked)[0].shape[0]
        at = lambda i: jax.tree.map(lambda a: a[i], stacked)  # noqa: E731
        with tp.manual_region():
            xs = schedules.split(schedule, x)
            if scan:
                # Layer 0 gets an all-zero pending step (its all-reduce adds nothing), so the
                # carry keeps one structure and one scan runs every layer: no peeled first
                # layer, no sliced copy of the stacked parameters.
                carry = (xs, _zero_pending(xs[schedule.steps[-1].sub_batch], at(0), ctx))
                carry, _ = jax.lax.scan(wrap(layer, True), carry, stacked)
            else:
                carry = (xs, None)
                for i in range(n):
                    carry, _ = wrap(layer, False)(carry, at(i))
            xs, pending = carry
            return schedules.join(schedules.finish_pending(schedule, xs, pending, MLP.complete))

    return jax.shard_map(local, mesh=ctx.mesh, in_specs=(_local_specs(stacked, ctx, True), x_spec),
                         out_specs=x_spec)(stacked, x_BLD)
