"""Norms and activations: float32 internals, compute-dtype inputs and outputs, and backwards
that keep only the compute-dtype inputs (plus the norms' [B, L] statistics).

Left to autodiff, an RMSNorm saves three float32 copies of its [B, L, D] input and a SwiGLU
three [B, L, F] products, per layer (24 GiB of a Llama-2 7B step on h100:8). The activations
recompute their float32 internals in the backward (`jax.checkpoint` around each; the recompute
is a few elementwise ops the backward fuses with its own). The norms have hand-written
backwards: autodiff of the recomputed norm also wrote the normalised input x_hat to memory in
float32 for the scale's gradient, two float32 passes over [B, L, D] per norm; here the scale and
bias gradients are one column reduction over x and dy, and dx one row-normalisation pass:

    x_hat = (x - mean) * rstd,   g = dy * scale
    dx = rstd * (g - mean_D(g) - x_hat * mean_D(g * x_hat))        (RMSNorm: no mean terms)
    dscale = sum_BL(dy * x_hat),  dbias = sum_BL(dy)

prevent_cse=False on the activations: the layers run under scan (or remat), where XLA cannot
merge the recomputation back into the forward, and the barriers prevent_cse adds cost the oases
step overlap (small on h100:8: 0.70 -> 0.65 of its tensor-axis bytes beside a GEMM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from oases_jax.compat import reduce_to_match

F32 = jnp.float32


def _rows(x: jax.Array) -> tuple[int, ...]:
    return tuple(range(x.ndim - 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x_BLD: jax.Array, scale_D: jax.Array, bias_D: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with float32 statistics, returned in the input's dtype."""
    return _ln_fwd(x_BLD, scale_D, bias_D, eps)[0]


def _ln_fwd(x_BLD, scale_D, bias_D, eps):
    with jax.named_scope("norm"):
        x = x_BLD.astype(F32)
        mean = x.mean(-1, keepdims=True)
        rstd = jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + eps)
        y = ((x - mean) * rstd * scale_D + bias_D).astype(x_BLD.dtype)
    # The statistics are saved [B, L]: a pipeline's residual pools then hold them in the shape
    # XLA carries (it drops the trailing 1).
    return y, (x_BLD, scale_D, bias_D, mean[..., 0], rstd[..., 0])


def _ln_bwd(eps, res, dy_BLD):
    x_BLD, scale_D, bias_D, mean, rstd = res
    mean, rstd = (a[..., None] for a in jax.lax.optimization_barrier((mean, rstd)))
    with jax.named_scope("norm"):
        x_hat = (x_BLD.astype(F32) - mean) * rstd
        dy = dy_BLD.astype(F32)
        g = dy * scale_D
        dx = rstd * (g - g.mean(-1, keepdims=True)
                     - x_hat * (g * x_hat).mean(-1, keepdims=True))
        dscale = (dy * x_hat).sum(_rows(dy)).astype(scale_D.dtype)
        dbias = dy.sum(_rows(dy)).astype(bias_D.dtype)
    # Inside shard_map a replicated scale's gradient sums the devices' parts.
    return (reduce_to_match(dx.astype(x_BLD.dtype), x_BLD), reduce_to_match(dscale, scale_D),
            reduce_to_match(dbias, bias_D))


layer_norm.defvjp(_ln_fwd, _ln_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x_BLD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with float32 statistics, returned in the input's dtype."""
    return _rms_fwd(x_BLD, scale_D, eps)[0]


def _rms_fwd(x_BLD, scale_D, eps):
    with jax.named_scope("norm"):
        x = x_BLD.astype(F32)
        rstd = jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
        y = (x * rstd * scale_D).astype(x_BLD.dtype)
    return y, (x_BLD, scale_D, rstd[..., 0])


def _rms_bwd(eps, res, dy_BLD):
    x_BLD, scale_D, rstd = res
    rstd = jax.lax.optimization_barrier(rstd)[..., None]
    with jax.named_scope("norm"):
        x_hat = x_BLD.astype(F32) * rstd
        dy = dy_BLD.astype(F32)
        g = dy * scale_D
        dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdims=True))
        dscale = (dy * x_hat).sum(_rows(dy)).astype(scale_D.dtype)
    return reduce_to_match(dx.astype(x_BLD.dtype), x_BLD), reduce_to_match(dscale, scale_D)


rms_norm.defvjp(_rms_fwd, _rms_bwd)


@functools.partial(jax.checkpoint, prevent_cse=False)
def swiglu(gate_BLF: jax.Array, up_BLF: jax.Array) -> jax.Array:
    with jax.named_scope("activation"):
        return jax.nn.silu(gate_BLF) * up_BLF


@functools.partial(jax.checkpoint, prevent_cse=False)
def gelu(h_BLF: jax.Array) -> jax.Array:
    """GELU in GPT-2's tanh form."""
    with jax.named_scope("activation"):
        return jax.nn.gelu(h_BLF, approximate=True)
