"""Collective matmuls: tensor-parallel projections whose collective is split into ring steps
that overlap the matmul of the chunk already in hand.

Call these inside `jax.shard_map` over the tensor axis `axis` (n devices, this one at index d):

- `all_gather_matmul(x_blk, w_blk)`: x is sequence-sharded ([B, L/n, D] here), w column-sharded
  ([D, F/n]); returns [B, L, F/n] = all_gather(x) @ w. The x chunks travel around the ring and
  each arriving chunk is multiplied while the next one is in flight.
- `matmul_reduce_scatter(h, w_blk)`: h is [B, L, F/n], w row-sharded ([F/n, D]); returns
  [B, L/n, D] = reduce_scatter(h @ w) over the sequence. Partial sums travel around the ring and
  each device adds its own partial for that chunk while the next transfer is in flight.

Both have hand-written backward passes that are rings themselves: the input gradient of an
all-gather matmul is a matmul reduce-scatter and its weight gradient accumulates as x travels
again; the reverse for a matmul reduce-scatter. `bidirectional=True` splits every transfer in
two halves that travel opposite ways, using both directions of each link.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from oases_jax.compat import reduce_to_match


def _shift(axis: str, n: int, s: int):
    return [(j, (j + s) % n) for j in range(n)]


def _rows(x: jax.Array, start, size: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=1)


def ring(axis: str, n: int, *, gathered: Sequence[tuple[jax.Array, int]] = (),
         scattered: Sequence[tuple[Callable[[jax.Array], jax.Array], int]] = (),
         consume: Callable | None = None, carry=None):
    """One ring loop driving several lanes at once.

    gathered: (block, s) lanes. The block travels `s` (+1: to the next device, -1: to the
        previous); at step i this device holds the block of device (d - s*i) mod n, and
        `consume(carry, lane, block, src)` folds it into `carry`.
    scattered: (partial, s) lanes. An accumulator travels `s`; at step i this device adds
        `partial(c)` for chunk c = (d - s*(i+1)) mod n, so after n-1 transfers it holds the full
        sum for chunk d.
    Every transfer of a step is issued before that step's matmuls, which do not depend on it.
    Returns (carry, [accumulated chunk per scattered lane]).
    """
    d = lax.axis_index(axis)
    xs = [x for x, _ in gathered]

    def chunk(s, step):  # the chunk a scattered lane works on at `step`
        return (d - s * (step + 1)) % n

    def fold(carry, xs, step):
        for k, (x, (_, s)) in enumerate(zip(xs, gathered, strict=True)):
            carry = consume(carry, k, x, (d - s * step) % n)
        return carry

    def permute(values, lanes):
        return [lax.ppermute(v, axis, _shift(axis, n, s))
                for v, (_, s) in zip(values, lanes, strict=True)]

    # A scattered lane's step adds a partial computed during that step's own transfer, so every
    # transfer, the last one included, has a GEMM beside it. The partial is fenced: XLA would
    # otherwise fuse the add of the arriving sum into the GEMM, which would then wait for it.
    accs = [p(chunk(s, 0)) for p, s in scattered]
    if n == 1:
        return fold(carry, xs, 0), accs

    def body(i, state):
        xs, accs, carry = state
        xs_next, accs_in = permute(xs, gathered), permute(accs, scattered)
        carry = fold(carry, xs, i - 1)
        parts = [lax.optimization_barrier(p(chunk(s, i))) for p, s in scattered]
        accs = [a + r for a, r in zip(accs_in, parts, strict=True)]
        return xs_next, accs, carry

    xs, accs, carry = lax.fori_loop(1, n, body, (xs, accs, carry))
    return fold(carry, xs, n - 1), accs


def _lanes(x: jax.Array, bidirectional: bool):
    """Gathered lanes of x along rows (axis 1): whole and clockwise, or two halves both ways."""
    if not bidirectional:
        return [(x, 1)], [0]
    h = x.shape[1] // 2
    return [(x[:, :h], 1), (x[:, h:], -1)], [0, h]


def _varying_zeros(shape, dtype, *like: jax.Array):
    """Zeros that vary over every mesh axis the `like` arrays vary over: a loop carry must keep
    one type from the first step to the last. (`zeros_like` carries that type along.)"""
    probe = functools.reduce(jnp.multiply, [a.reshape(-1)[0] for a in like])
    return jnp.zeros_like(probe, dtype=dtype, shape=shape)


def _gather_matmul(x, w, axis, n, bidirectional, extra_scattered=()):
    """Ring-gathered x @ w; also drives extra scattered lanes in the same loop."""
    b, lc, _ = x.shape
    lanes, offsets = _lanes(x, bidirectional)

    def consume(out, k, chunk, src):
        return lax.dynamic_update_slice_in_dim(out, chunk @ w, src * lc + offsets[k], axis=1)

    out = _varying_zeros((b, n * lc, w.shape[1]), jnp.result_type(x, w), x, w)
    return ring(axis, n, gathered=lanes, scattered=extra_scattered, consume=consume, carry=out)


def _scatter_lanes(h, w, lc, bidirectional):
    """Scattered lanes for chunks of (h @ w): whole and clockwise, or column halves both ways."""
    if not bidirectional:
        return [(lambda c: _rows(h, c * lc, lc) @ w, 1)]
    half = w.shape[1] // 2
    return [(lambda c: _rows(h, c * lc, lc) @ w[:, :half], 1),
            (lambda c: _rows(h, c * lc, lc) @ w[:, half:], -1)]


def _join(accs):
    return accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=-1)


def _check(x_rows: int, bidirectional: bool, what: str):
    if bidirectional and x_rows % 2:
        raise ValueError(f"{what}: a bidirectional ring needs an even block, got {x_rows} rows")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def all_gather_matmul(x_blk: jax.Array, w_blk: jax.Array, axis: str,
                      bidirectional: bool = False) -> jax.Array:
    """all_gather(x_blk, rows) @ w_blk as a ring. x_blk: [B, L/n, D], w_blk: [D, F/n]."""
    _check(x_blk.shape[1], bidirectional, "all_gather_matmul")
    n = lax.axis_size(axis)
    return _gather_matmul(x_blk, w_blk, axis, n, bidirectional)[0]


def _agmm_fwd(x, w, axis, bidirectional):
    return all_gather_matmul(x, w, axis, bidirectional), (x, w)


def _agmm_bwd(axis, bidirectional, res, dy):
    # dy: [B, L, F/n]. dx = reduce_scatter(dy @ w^T); dw = all_gather(x)^T @ dy, as x travels.
    x, w = res
    n = lax.axis_size(axis)
    b, lc, _ = x.shape
    lanes, offsets = _lanes(x, bidirectional)

    def consume(dw, k, chunk, src):
        dy_rows = _rows(dy, src * lc + offsets[k], chunk.shape[1])
        return dw + jnp.einsum("bld,blf->df", chunk, dy_rows)

    dw0 = _varying_zeros(w.shape, w.dtype, x, w, dy)
    dw, accs = ring(axis, n, gathered=lanes, scattered=_scatter_lanes(dy, w.T, lc, bidirectional),
                    consume=consume, carry=dw0)
    return _join(accs).astype(x.dtype), reduce_to_match(dw, w).astype(w.dtype)


all_gather_matmul.defvjp(_agmm_fwd, _agmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul_reduce_scatter(h: jax.Array, w_blk: jax.Array, axis: str,
                          bidirectional: bool = False) -> jax.Array:
    """reduce_scatter(h @ w_blk, rows) as a ring. h: [B, L, F/n], w_blk: [F/n, D]."""
    n = lax.axis_size(axis)
    lc = h.shape[1] // n
    _check(w_blk.shape[1], bidirectional, "matmul_reduce_scatter")
    _, accs = ring(axis, n, scattered=_scatter_lanes(h, w_blk, lc, bidirectional))
    return _join(accs)


def _mmrs_fwd(h, w, axis, bidirectional):
    return matmul_reduce_scatter(h, w, axis, bidirectional), (h, w)


def _mmrs_bwd(axis, bidirectional, res, dy):
    # dy: [B, L/n, D]. dh = all_gather(dy) @ w^T; dw = h^T @ all_gather(dy), as dy travels.
    h, w = res
    n = lax.axis_size(axis)
    lc = dy.shape[1]
    _check(lc, bidirectional, "matmul_reduce_scatter backward")
    lanes, offsets = _lanes(dy, bidirectional)

    def consume(carry, k, chunk, src):
        dh, dw = carry
        start = src * lc + offsets[k]
        dh = lax.dynamic_update_slice_in_dim(dh, chunk @ w.T, start, axis=1)
        dw = dw + jnp.einsum("blf,bld->fd", _rows(h, start, chunk.shape[1]), chunk)
        return dh, dw

    init = (_varying_zeros(h.shape, h.dtype, h, w, dy), _varying_zeros(w.shape, w.dtype, h, w, dy))
    (dh, dw), _ = ring(axis, n, gathered=lanes, consume=consume, carry=init)
    return reduce_to_match(dh, h).astype(h.dtype), reduce_to_match(dw, w).astype(w.dtype)


matmul_reduce_scatter.defvjp(_mmrs_fwd, _mmrs_bwd)


# Plain references on global arrays.


def all_gather_matmul_reference(x_BLD: jax.Array, w_DF: jax.Array) -> jax.Array:
    return jnp.einsum("bld,df->blf", x_BLD, w_DF)


def matmul_reduce_scatter_reference(h_BLF: jax.Array, w_FD: jax.Array) -> jax.Array:
    return jnp.einsum("blf,fd->bld", h_BLF, w_FD)
