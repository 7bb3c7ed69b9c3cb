"""Parm S2's exchange of a slot buffer with the experts, pipelined over capacity chunks, with its
own chunk count for the forward and for the backward (docs/parallelism.md, "Mixture of experts").

Autodiff would transpose a chunked forward into a backward with the same chunks. Here the two
collective stages are linear maps with hand-written transposes: `dispatch` (all-to-all over EP,
then ESP all-gather over MP) and `combine` (ESP reduce-scatter, output bias, all-to-all back).
Each runs its forward over r_f chunks and its backward over r_b chunks; the expert FFN between
them runs (and is differentiated by autodiff) per forward chunk. Between the two granularities
the buffers are re-cut along the slot axis of their [E/ep, mp, ep, S, D] layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from oases_jax import compat


def padded_slots(capacity: int, fwd_chunks: int, bwd_chunks: int) -> int:
    """Slots per expert in S2's buffer: the capacity rounded up to a multiple of both counts."""
    m = math.lcm(fwd_chunks, bwd_chunks)
    return -(-capacity // m) * m


def _rechunk(parts: tuple, mp: int, ep: int, r: int) -> tuple:
    """Chunks [E/ep, mp*ep*s, D] (rows: MP source, EP source, slot) re-cut into `r` chunks of
    the same layout along the slot axis. Each new chunk is built from the old chunks it
    overlaps only, so it waits for them and no others."""
    if len(parts) == r:
        return tuple(parts)
    el, n, d = parts[0].shape
    s_old = n // (mp * ep)
    blocks = [p.reshape(el, mp, ep, s_old, d) for p in parts]
    s_new = s_old * len(parts) // r
    out = []
    for j in range(r):
        lo, hi = j * s_new, (j + 1) * s_new
        pieces = [b[:, :, :, max(lo - i * s_old, 0):min(hi - i * s_old, s_old)]
                  for i, b in enumerate(blocks) if i * s_old < hi and lo < (i + 1) * s_old]
        piece = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=3)
        out.append(piece.reshape(el, mp * ep * s_new, d))
    return tuple(out)


def _split(buf, r: int) -> list:
    return jnp.split(buf, r, axis=1)


def exchange(buf_ESD: jax.Array, w_local, bias_local: jax.Array | None, expert_fn: Callable,
             *, ep: str | None, mp: str | None, ep_size: int, mp_size: int, fwd_chunks: int,
             bwd_chunks: int) -> jax.Array:
    """Slots [E, S, D] -> the experts' outputs in the same slots (S divisible by both chunk
    counts), inside the layer's shard_map: per forward chunk all-to-all -> all-gather -> FFN ->
    reduce-scatter -> + bias -> all-to-all back; the backward's collectives per backward
    chunk."""
    rf, rb = fwd_chunks, bwd_chunks

    def a2a_in(x):  # [E, s, D] -> [E/ep, ep*s, D]
        return jax.lax.all_to_all(x, ep, 0, 1, tiled=True) if ep else x

    def a2a_out(x):  # [E/ep, ep*s, D] -> [E, s, D]
        return jax.lax.all_to_all(x, ep, 1, 0, tiled=True) if ep else x

    def gather(x):  # [E/ep, ep*s, D] -> [E/ep, mp*ep*s, D]
        return jax.lax.all_gather(x, mp, axis=1, tiled=True) if mp else x

    def scatter(x):  # [E/ep, mp*ep*s, D] -> [E/ep, ep*s, D], summed over MP
        return jax.lax.psum_scatter(x, mp, scatter_dimension=1, tiled=True) if mp else x

    @jax.custom_vjp
    def dispatch(buf):
        return tuple(gather(a2a_in(p)) for p in _split(buf, rf))

    def dispatch_bwd(_, cts):
        parts = _rechunk(cts, mp_size, ep_size, rb)
        return (jnp.concatenate([a2a_out(scatter(p)) for p in parts], axis=1),)

    dispatch.defvjp(lambda buf: (dispatch(buf), None), dispatch_bwd)

    @jax.custom_vjp
    def combine(ys, bias):
        outs = []
        for y in ys:
            z = scatter(y)
            if bias is not None:
                z = z + bias[:, None, :].astype(z.dtype)
            outs.append(a2a_out(z))
        return jnp.concatenate(outs, axis=1)

    def combine_bwd(bias, ct):
        parts, d_bias = [], None
        for c in _split(ct, rb):
            c = a2a_in(c)
            if bias is not None:
                s = jnp.sum(c, axis=1)
                d_bias = s if d_bias is None else d_bias + s
            parts.append(gather(c))
        if bias is not None:  # summed over the axes the bias is replicated on
            d_bias = compat.reduce_to_match(d_bias.astype(bias.dtype), bias)
        return _rechunk(tuple(parts), mp_size, ep_size, rf), d_bias

    combine.defvjp(lambda ys, bias: (combine(ys, bias), bias), combine_bwd)

    ys = tuple(expert_fn(w_local, g) for g in dispatch(buf_ESD))
    return combine(ys, bias_local)
