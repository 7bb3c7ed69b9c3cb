"""PrimePar spatial-temporal partitioning: Y = X W on a q x q square of devices, split over
devices and over q time steps, so partial sums accumulate by rotation instead of an all-reduce.

Call the two projections inside `jax.shard_map` over the square's row axis `rows` (index i) and
column axis `cols` (index j); blocks are numbered mod q; M are tokens, K inputs, N outputs:

- `column_matmul(x, w)` (X stationary; QKV, MLP in). Device (i, j) holds X[i, j] ([M/q, K/q],
  the plain layout) and stores W[j, i+j-1] ([K/q, N/q]). Step t multiplies X[i, j] by
  W[j, i+j-1-t]; W blocks move down the rows and the partial sum of Y[i, n] moves right along
  the columns. The output is skewed: device (i, j) ends with Y[i, i+j].
- `row_matmul(x, w)` (output stationary, Cannon; attention out, MLP out). Device (i, j) holds
  the skewed X[i, i+j] and stores W[i+j, j]. Step t multiplies X[i, i+j+t] by W[i+j+t, j]; X
  blocks move left, W blocks move up. The output Y[i, j] is in the plain layout.

So a column projection feeds a row projection with no data movement between them (the skewed
layout is what both sides use), and the row projection gives back the plain layout. `skew` /
`unskew` move an activation between the layouts (one ppermute) for other chains.

Backward passes are hand-written, and each has its own rotations:

- column: dX[i, j] = sum_n dY[i, n] W[j, n]^T stays put while dY moves left and W moves up;
  dW[j, n] = sum_m X[m, j]^T dY[m, n] uses the same dY blocks, its partial sums move up.
- row: dX[i, k] = sum_n dY[i, n] W[k, n]^T: dY stays put, W moves down, partial sums move
  right. dW[k, j] = sum_m X[m, k]^T dY[m, j] starts from the forward's last X block,
  X[i, i+j-1]; X moves right, partial sums move down.

Both weight gradients end in W's stored block, so the optimizer update is purely local.
Every step's transfers are issued before its matmuls, which never wait on them; each step's
matmul operands are pinned behind the previous step's products (`optimization_barrier`), so XLA
neither merges the per-step GEMMs into one nor runs them ahead of the transfers they should hide.
Four more fences keep every transfer beside a GEMM in XLA's GPU schedule (measured on the
compiled H100 program, docs/parallelism.md): a step passes its blocks on only after the previous
step's products (so for q > 2 the chained shifts of one lane take one GEMM window each); a column
step's partial sum leaves after that step's W block has arrived; the row forward's saved X block
is paired with its output; and a backward hands dX on only with dW's last partial sum arrived.
Formulas, the 2x2 worked example and the costs: docs/parallelism.md, "PrimePar".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from oases_jax.compat import reduce_to_match
from oases_jax.errors import UserError

KINDS = ("column", "row")


def square_size(mesh_shape, rows: str, cols: str) -> int:
    """q, the side of the square the mesh gives `rows` x `cols`; UserError if it is not square."""
    r, c = mesh_shape.get(rows, 1), mesh_shape.get(cols, 1)
    if r != c:
        raise UserError(
            f"primepar needs a square of devices, but mesh axes {rows}={r} and {cols}={c} "
            f"differ; give both the same size, e.g. {rows}=2,{cols}=2"
        )
    return r


def _shift(x: jax.Array, axis: str, q: int, s: int) -> jax.Array:
    """Every device sends its `x` to the device `s` further along `axis` (+1: next)."""
    return lax.ppermute(x, axis, [(d, (d + s) % q) for d in range(q)])


def _after(done: list, *xs):
    """`xs`, available only once the products in `done` are computed (no-op for none)."""
    if not done:
        return xs
    return lax.optimization_barrier((tuple(done), xs))[1]


# Each product is fenced: XLA would otherwise fuse the add of a partial sum that just arrived
# into the GEMM's epilogue, and the GEMM would wait for the transfer it should hide.


def _fence(y):
    return lax.optimization_barrier(y)


def _mm(x, w):  # [..., K] @ [K, N]
    return _fence(jnp.einsum("...k,kn->...n", x, w))


def _mm_t(dy, w):  # [..., N] @ [K, N]^T
    return _fence(jnp.einsum("...n,kn->...k", dy, w))


def _wgrad(x, dy):  # [..., K]^T @ [..., N], summed over the leading (token) dims
    return _fence(jnp.einsum("...k,...n->kn", x, dy))


# Column projection: X stationary.


def _column_forward(x, w, rows, cols):
    q = lax.axis_size(rows)
    acc, done, w_t = None, [], w
    for t in range(q):
        x_t, w_p = _after(done, x, w_t)
        w_next = _shift(w_p, rows, q, +1) if t < q - 1 else None  # W[j, i+j-2-t] from above
        # The partial of Y[i, i+j-1-t] from the left. It leaves once this step's W block is in:
        # unfenced, XLA's scheduler opened its window first and ran the W shift synchronously.
        acc_in = _shift(_after([w_t], acc)[0], cols, q, +1) if t else None
        p = _mm(x_t, w_p)
        acc, done, w_t = (p if t == 0 else acc_in + p), [p], w_next
    return acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def column_matmul(x: jax.Array, w: jax.Array, rows: str, cols: str) -> jax.Array:
    """Y = X W, X stationary. x: X[i, j] ([..., K/q]); w: stored block W[j, i+j-1] ([K/q, N/q]).
    Returns the skewed Y[i, i+j] ([..., N/q]). Moves q-1 W blocks and q-1 partial sums."""
    return _column_forward(x, w, rows, cols)


def _column_fwd(x, w, rows, cols):
    return _column_forward(x, w, rows, cols), (x, w)


def _column_bwd(rows, cols, res, dy):
    # dy: dY[i, i+j]. Step t holds dY_t = dY[i, i+j+t] (moving left) and W_t = W[j, i+j-1+t]
    # (moving up); dW's partial for stored block W[j, i+j+t] moves up to row i+t+1.
    x, w = res
    q = lax.axis_size(rows)
    dy_next = _shift(dy, cols, q, -1) if q > 1 else None
    w_next = _shift(w, rows, q, -1) if q > 1 else None
    acc_w = _wgrad(x, dy)
    done, dy_prev, dx = [acc_w], dy, None
    for t in range(1, q):
        x_p, dy_prev_p, w_p, dy_p = _after(done, x, dy_prev, w_next, dy_next)
        if t < q - 1:
            dy_next, w_next = _shift(dy_p, cols, q, -1), _shift(w_p, rows, q, -1)
        acc_in = _shift(acc_w, rows, q, -1)
        px, pw = _mm_t(dy_prev_p, w_p), _wgrad(x_p, dy_p)  # dY_{t-1} W_t^T; X^T dY_t
        dx = px if dx is None else dx + px
        acc_w, done, dy_prev = acc_in + pw, [px, pw], dy_p
    dy_last, w_own = _after(done, dy_prev, w)
    px = _mm_t(dy_last, w_own)  # dY[i, i+j-1] W[j, i+j-1]^T with the stored block
    dx = px if dx is None else dx + px
    (dx,) = _after([acc_w], dx)  # dX leaves with dW complete (see _row_bwd)
    return reduce_to_match(dx, x).astype(x.dtype), reduce_to_match(acc_w, w).astype(w.dtype)


column_matmul.defvjp(_column_fwd, _column_bwd)


# Row projection: output stationary (Cannon).


def _row_forward(x, w, rows, cols):
    q = lax.axis_size(rows)
    y, done = None, []
    for t in range(q):
        x_p, w_p = _after(done, x, w)
        if t < q - 1:  # X[i, i+j+t+1] from the right, W[i+j+t+1, j] from below
            x_next, w_next = _shift(x_p, cols, q, -1), _shift(w_p, rows, q, -1)
        p = _mm(x_p, w_p)
        y, done = (p if y is None else y + p), [p]
        if t < q - 1:
            x, w = x_next, w_next
    return y, x


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def row_matmul(x: jax.Array, w: jax.Array, rows: str, cols: str) -> jax.Array:
    """Y = X W, Y stationary. x: skewed X[i, i+j] ([..., K/q]); w: stored block W[i+j, j]
    ([K/q, N/q]). Returns Y[i, j] ([..., N/q]). Moves q-1 X blocks and q-1 W blocks."""
    return _row_forward(x, w, rows, cols)[0]


def _row_fwd(x, w, rows, cols):
    y, x_last = _row_forward(x, w, rows, cols)
    # The last X block, X[i, i+j-1], is where the weight gradient starts. It is saved after the
    # forward's products: a scan stores residuals with an asynchronous copy that XLA starts as
    # early as it can, and that copy would pull the X shift's end ahead of the GEMM it hides.
    y, x_last = lax.optimization_barrier((y, x_last))  # both used: XLA keeps the pairing
    return y, (x_last, w)


def _row_bwd(rows, cols, res, dy):
    # dy: dY[i, j], stays put. dW lane: X_t = X[i, i+j-1-t] moves right, the partial of stored
    # block W[i+j-1-t, j] moves down. dX lane: W_t = W[i+j-1-t, j] moves down (W_{q-1} is the
    # stored block), the partial of dX[i, i+j-1-t] moves right.
    x_t, w = res
    q = lax.axis_size(rows)
    if q > 1:
        w_next, x_next = _shift(w, rows, q, +1), _shift(x_t, cols, q, +1)
    acc_w = _wgrad(x_t, dy)
    done, acc_x = [acc_w], None
    for t in range(1, q):
        dy_p, w_p, x_p = _after(done, dy, w_next, x_next)
        if t < q - 1:
            w_next, x_next = _shift(w_p, rows, q, +1), _shift(x_p, cols, q, +1)
        accw_in = _shift(acc_w, rows, q, +1)
        accx_in = _shift(acc_x, cols, q, +1) if t >= 2 else None
        px, pw = _mm_t(dy_p, w_p), _wgrad(x_p, dy_p)  # dY W_{t-1}^T; X_t^T dY
        acc_x = px if accx_in is None else accx_in + px
        acc_w, done = accw_in + pw, [px, pw]
    accx_in = _shift(acc_x, cols, q, +1) if q > 1 else None
    dy_p, w_p = _after(done, dy, w)
    px = _mm_t(dy_p, w_p)
    acc_x = px if accx_in is None else accx_in + px
    # dX leaves once dW's last partial sum has arrived. Else XLA defers every projection's last
    # dW transfer to the end of the backward, where they queue behind each other with no GEMM.
    (acc_x,) = _after([acc_w], acc_x)
    return reduce_to_match(acc_x, x_t).astype(x_t.dtype), reduce_to_match(acc_w, w).astype(w.dtype)


row_matmul.defvjp(_row_fwd, _row_bwd)


# Activation layouts.


def skew(x: jax.Array, rows: str, cols: str) -> jax.Array:
    """Plain -> skewed activation: device (i, j) gets block i+j of its row (one ppermute)."""
    q = lax.axis_size(rows)
    pairs = [(i * q + (i + j) % q, i * q + j) for i in range(q) for j in range(q)]
    return lax.ppermute(x, (rows, cols), pairs) if q > 1 else x


def unskew(x: jax.Array, rows: str, cols: str) -> jax.Array:
    """Skewed -> plain activation (the inverse of `skew`)."""
    q = lax.axis_size(rows)
    pairs = [(i * q + j, i * q + (i + j) % q) for i in range(q) for j in range(q)]
    return lax.ppermute(x, (rows, cols), pairs) if q > 1 else x


# Weight layouts. A stored weight has the standard shape; its q x q grid of blocks (input dim
# `in_axis`, output dim `out_axis`) is permuted. Under the primepar rules the input dim of a column
# weight and the output dim of a row weight are sharded over `rows`, the other over `cols`, so
# device (i, j) holds block [i, j] of a stored column weight and block [j, i] of a stored row one.


def source_block(kind: str, p_in: int, p_out: int, q: int) -> tuple[int, int]:
    """The standard block (in, out) that a stored weight keeps at block position (p_in, p_out)."""
    if kind == "column":  # device (i, j) = (p_in, p_out) stores W[j, i+j-1]
        return p_out, (p_in + p_out - 1) % q
    if kind == "row":  # device (i, j) = (p_out, p_in) stores W[i+j, j]
        return (p_in + p_out) % q, p_in
    raise ValueError(f"weight kind {kind!r} is not one of {KINDS}")


def _permute_blocks(w, q: int, in_axis: int, out_axis: int, src_of):
    in_axis, out_axis = in_axis % w.ndim, out_axis % w.ndim
    if q == 1:
        return w
    xp = np if isinstance(w, np.ndarray) else jnp
    moved = xp.moveaxis(w, (in_axis, out_axis), (0, 1))
    a, b = moved.shape[0] // q, moved.shape[1] // q
    blocks = moved.reshape(q, a, q, b, *moved.shape[2:])
    rows_out = []
    for p_in in range(q):
        row = [blocks[s[0], :, s[1]] for s in (src_of(p_in, p_out) for p_out in range(q))]
        rows_out.append(xp.concatenate(row, axis=1))
    return xp.moveaxis(xp.concatenate(rows_out, axis=0), (0, 1), (in_axis, out_axis))


def to_stored(w, kind: str, q: int, *, in_axis: int = 0, out_axis: int = -1):
    """Standard -> stored layout of a weight (numpy or jax array; q must divide both dims)."""
    return _permute_blocks(w, q, in_axis, out_axis, lambda i, o: source_block(kind, i, o, q))


def to_standard(w, kind: str, q: int, *, in_axis: int = 0, out_axis: int = -1):
    """Stored -> standard layout of a weight (the inverse of `to_stored`)."""
    where = {source_block(kind, i, o, q): (i, o) for i in range(q) for o in range(q)}
    return _permute_blocks(w, q, in_axis, out_axis, lambda i, o: where[(i, o)])


def relayout_pairs(kind: str, q: int, *, stored: bool) -> list[tuple[int, int]]:
    """ppermute pairs over (rows, cols) that turn a sharded standard weight into the stored
    one (`stored=True`) or back, for the shardings the primepar rules give (see above)."""

    def device(p_in, p_out):  # linear index over (rows, cols) of a block position
        return (p_in * q + p_out) if kind == "column" else (p_out * q + p_in)

    pairs = []
    for p_in in range(q):
        for p_out in range(q):
            src, dst = device(*source_block(kind, p_in, p_out, q)), device(p_in, p_out)
            pairs.append((src, dst) if stored else (dst, src))
    return pairs


# Plain references on global arrays.


def matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """Y = X W over the last dim of x: what both projections compute, in standard layouts."""
    return jnp.einsum("...k,kn->...n", x, w)
