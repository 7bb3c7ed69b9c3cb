"""Tensor-parallel projections that follow the active schedule.

Models call `column_parallel` (D -> heads/mlp, e.g. QKV, MLP in) and `row_parallel`
(heads/mlp -> D, e.g. attention out, MLP out) with logical names for the weights. Under the GSPMD
schedules (megatron, megatron_sp, xla_auto) they are plain einsums and the partitioner inserts
the collectives. Under `collective_matmul` they run the ring primitives of
`oases_jax.collective_matmul` inside `shard_map` over the tensor axis: the sequence-sharded
residual stream is gathered chunk by chunk into the column-parallel matmul, and the row-parallel
matmul's partial sums are reduce-scattered back onto the sequence, both overlapped with compute.
Under `primepar` they run `oases_jax.primepar` on the `rows` x `cols` square: column projections
return the skewed layout that row projections take (`add_bias` adds a bias in it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from oases_jax import primepar, schedules
from oases_jax.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from oases_jax.rules import Logical, ShardingRules

RING_SCHEDULES = ("collective_matmul", "oases_cm")
SUB_BATCH_SCHEDULES = ("oases", "oases_cm")
PRIMEPAR = "primepar"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How projections run: `schedule`, on `mesh` under `rules`, rings over `axis`."""

    schedule: str
    rules: ShardingRules
    mesh: Mesh
    axis: str = "tensor"
    bidirectional: bool = True
    sub_batches: int = 2  # for the Oases schedules
    rows: str = "tp_row"  # primepar: the square's axes
    cols: str = "tp_col"

    def __post_init__(self):
        if self.schedule == PRIMEPAR:
            primepar.square_size(self.mesh.shape, self.rows, self.cols)

    @property
    def uses_primepar(self) -> bool:
        return self.schedule == PRIMEPAR and self.mesh.shape.get(self.rows, 1) > 1

    @property
    def uses_rings(self) -> bool:
        return self.schedule in RING_SCHEDULES and self.mesh.shape.get(self.axis, 1) > 1

    @property
    def manual_layer(self) -> bool:
        """Sub-batch schedules run each layer inside one shard_map, so the executor can order
        one sub-batch's collective against another's compute."""
        return self.schedule in SUB_BATCH_SCHEDULES and self.mesh.shape.get(self.axis, 1) > 1

    @property
    def pipelined_stack(self) -> bool:
        """Oases with all-reduces and at least two sub-batches: a scanned stack of layers runs
        in one shard_map, each layer leaving its last all-reduce pending for the next layer's
        first sub-batch to hide (see `models.layers.pipelined_layers`)."""
        return self.manual_layer and self.schedule == "oases" and self.sub_batches > 1

    @property
    def layer_schedule(self) -> schedules.Schedule:
        if self.schedule in SUB_BATCH_SCHEDULES:
            return schedules.oases(self.sub_batches)
        return schedules.sequential()


_ACTIVE: contextvars.ContextVar[TensorParallel | None] = contextvars.ContextVar(
    "oases_jax_tensor_parallel", default=None)
# Inside a manual (shard_map) layer region: projections are local, collectives explicit, and the
# row projections leave their pre-collective partial here for the sub-batch executor.
_MANUAL: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "oases_jax_manual_region", default=None)


# Inside a manual region: the output of the last executed schedule step (see `anchor`).
_ANCHOR: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "oases_jax_anchor", default=None)


def active() -> TensorParallel | None:
    return _ACTIVE.get()


def layer_schedule() -> schedules.Schedule:
    """The order of work inside a layer under the active schedule (sequential without one)."""
    tp = _ACTIVE.get()
    return tp.layer_schedule if tp is not None else schedules.sequential()


def uses_rings() -> bool:
    """Whether projections carry their own communication (rings or primepar), so that their
    outputs are post-collective values a remat policy may keep."""
    tp = _ACTIVE.get()
    return tp is not None and (tp.uses_rings or tp.uses_primepar)


@contextlib.contextmanager
def manual_region():
    """Mark code traced inside a layer's shard_map (see `TensorParallel.manual_layer`)."""
    from oases_jax.rules import suspend_rules

    token, anchor_token = _MANUAL.set([]), _ANCHOR.set(None)
    try:
        with suspend_rules():
            yield
    finally:
        _MANUAL.reset(token)
        _ANCHOR.reset(anchor_token)


def take_pending() -> list[jax.Array]:
    """The pre-collective partials produced since the last call (manual regions only)."""
    pending = _MANUAL.get()
    if pending is None:
        return []
    out = list(pending)
    pending.clear()
    return out


def anchor(x: jax.Array) -> None:
    """Record a step's output (manual regions): the next collective's result is used only after
    it (`_after_anchor`). XLA would otherwise fuse the residual adds of two sub-batches into one
    multi-output fusion (they share the bias), which waits for both sub-batches' all-reduces
    and so serialises the second one behind the first."""
    pending = _MANUAL.get()
    if pending is not None:
        _ANCHOR.set(x)


def _after_anchor(y: jax.Array) -> jax.Array:
    prev = _ANCHOR.get()
    if prev is None:
        return y
    return jax.lax.optimization_barrier((prev, y))[1]


def pin_order(x: jax.Array) -> jax.Array:
    """Make `x` available only once the partials produced so far are computed. Applied to the
    next sub-batch's input, it keeps XLA from hoisting that sub-batch's compute above the
    previous one's projection, so the previous one's all-reduce has compute to hide behind."""
    pending = take_pending()
    if not pending:
        return x
    return jax.lax.optimization_barrier((*pending, x))[-1]


@contextlib.contextmanager
def use_tensor_parallel(tp: TensorParallel):
    token = _ACTIVE.set(tp)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _flat(w: jax.Array, n_in: int) -> jax.Array:
    return w.reshape(math.prod(w.shape[:n_in]), -1)


def column_parallel(x_BLD: jax.Array, weights: Sequence[jax.Array],
                    names: Sequence[Logical]) -> list[jax.Array]:
    """[x @ w for w in weights], each w of shape [D, *out] named ("embed", *out_names); the
    outputs are [B, L, *out]. Under a ring schedule all weights share one all-gather ring."""
    tp = _ACTIVE.get()
    if tp is not None and tp.uses_primepar and _MANUAL.get() is None:
        return _primepar_column(x_BLD, weights, names, tp)
    if _MANUAL.get() is not None and tp.uses_rings:  # already per device: the ring itself
        return list(_gather_local(x_BLD, weights, tp.axis, tp.bidirectional))
    if tp is None or not tp.uses_rings or _MANUAL.get() is not None:
        return [jnp.einsum("bld,d...->bl...", x_BLD, w) for w in weights]
    rules, mesh = tp.rules, tp.mesh
    x_spec = rules.act_spec(("batch", "seq", "embed"), mesh)
    w_specs = [rules.param_spec(n, mesh) for n in names]
    out_specs = tuple(rules.act_spec(("batch", None, *n[1:]), mesh) for n in names)

    def local(x, *ws):
        return _gather_local(x, ws, tp.axis, tp.bidirectional)

    outs = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, *w_specs), out_specs=out_specs)(
        x_BLD, *weights)
    return list(outs)


def _gather_local(x, ws, axis: str, bidirectional: bool) -> tuple[jax.Array, ...]:
    """Per device: one all-gather ring for all weights (concatenated), split again."""
    bidirectional = bidirectional and x.shape[1] % 2 == 0
    flat = [_flat(w, 1) for w in ws]
    y = all_gather_matmul(x, jnp.concatenate(flat, axis=1), axis, bidirectional)
    cuts = [sum(f.shape[1] for f in flat[: i + 1]) for i in range(len(flat) - 1)]
    parts = jnp.split(y, cuts, axis=-1)
    return tuple(p.reshape(*p.shape[:2], *w.shape[1:]) for p, w in zip(parts, ws, strict=True))


def row_partial(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [B, L, *in] @ w [*in, D] on the blocks at hand. Inside a manual region it is this
    device's partial sum, its all-reduce left to `complete_partial` (a pipelined stack issues
    it in the next layer)."""
    letters = "ijkm"[: w.ndim - 1]
    return jnp.einsum(f"bl{letters},{letters}d->bld", h, w)


def complete_partial(partial: jax.Array) -> jax.Array:
    """The all-reduce of a `row_partial`. Not tied to the last step's output (`anchor`): the
    pipelined stack completes it while other sub-batches' steps run, and a tie to one of them
    would serialise that step's own all-reduce behind it."""
    return jax.lax.psum(partial, _ACTIVE.get().axis)


def row_parallel(h: jax.Array, w: jax.Array, names: Logical) -> jax.Array:
    """h [B, L, *in] @ w [*in, D] -> [B, L, D], w named (*in_names, "embed"). Under a ring
    schedule the result is reduce-scattered onto the sequence by a ring."""
    tp = _ACTIVE.get()
    n_in = w.ndim - 1
    manual = _MANUAL.get()
    if tp is not None and tp.uses_primepar and manual is None:
        return _primepar_row(h, w, names, tp)
    if manual is not None and tp.uses_rings:
        bidirectional = tp.bidirectional and w.shape[-1] % 2 == 0
        return matmul_reduce_scatter(h.reshape(*h.shape[:2], -1), _flat(w, n_in), tp.axis,
                                     bidirectional)
    if manual is not None:  # Megatron inside the layer's shard_map: local partial, then psum
        partial = row_partial(h, w)
        manual.append(partial)
        return _after_anchor(jax.lax.psum(partial, tp.axis))
    if tp is None or not tp.uses_rings:
        return row_partial(h, w)  # the whole product: GSPMD inserts any collective
    rules, mesh = tp.rules, tp.mesh
    h_spec = rules.act_spec(("batch", None, *names[:-1]), mesh)
    out_spec = rules.act_spec(("batch", "seq", "embed"), mesh)
    bidirectional = tp.bidirectional and w.shape[-1] % 2 == 0

    def local(h, w):
        h_flat = h.reshape(*h.shape[:2], -1)
        return matmul_reduce_scatter(h_flat, _flat(w, n_in), tp.axis, bidirectional)

    return jax.shard_map(local, mesh=mesh, in_specs=(h_spec, rules.param_spec(names, mesh)),
                         out_specs=out_spec)(h, w)


# PrimePar: projections on the rows x cols square (docs/parallelism.md, "PrimePar").


def _primepar_column(x_BLD, weights, names, tp: TensorParallel) -> list[jax.Array]:
    rules, mesh = tp.rules, tp.mesh
    x_spec = rules.act_spec(("batch", "seq", "embed"), mesh)
    w_specs = [rules.param_spec(n, mesh) for n in names]
    out_specs = tuple(rules.act_spec(("batch", None, *n[1:]), mesh) for n in names)

    def local(x, *ws):  # x: X[i, j] [B/(dp q), L, D/q]; ws: stored blocks W[j, i+j-1]
        flat = [_flat(w, 1) for w in ws]
        y = primepar.column_matmul(x, jnp.concatenate(flat, axis=1), tp.rows, tp.cols)
        cuts = [sum(f.shape[1] for f in flat[: i + 1]) for i in range(len(flat) - 1)]
        parts = jnp.split(y, cuts, axis=-1)  # skewed: Y[i, i+j]
        return tuple(p.reshape(*p.shape[:2], *w.shape[1:]) for p, w in zip(parts, ws, strict=True))

    outs = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, *w_specs), out_specs=out_specs)(
        x_BLD, *weights)
    return list(outs)


def _primepar_row(h, w, names, tp: TensorParallel) -> jax.Array:
    rules, mesh = tp.rules, tp.mesh
    n_in = w.ndim - 1
    h_spec = rules.act_spec(("batch", None, *names[:-1]), mesh)
    out_spec = rules.act_spec(("batch", "seq", "embed"), mesh)

    def local(h, w):  # h: skewed X[i, i+j]; w: stored block W[i+j, j]
        h_flat = h.reshape(*h.shape[:2], -1)
        return primepar.row_matmul(h_flat, _flat(w, n_in), tp.rows, tp.cols)

    return jax.shard_map(local, mesh=mesh, in_specs=(h_spec, rules.param_spec(names, mesh)),
                         out_specs=out_spec)(h, w)


def add_bias(y: jax.Array, b: jax.Array, names: Logical) -> jax.Array:
    """y + b for a column projection's output y [B, L, *out] and its bias b [*out] named
    `names`. Under primepar y is skewed (device (i, j) holds output block i+j), so the bias
    blocks are skewed too: one small ppermute, no gather."""
    tp = _ACTIVE.get()
    if tp is None or not tp.uses_primepar or _MANUAL.get() is not None:
        return y + b
    y_spec = tp.rules.act_spec(("batch", None, *names), tp.mesh)

    def local(y, b):  # b: block j of the bias, the same on every row
        return y + primepar.skew(b, tp.rows, tp.cols)

    return jax.shard_map(local, mesh=tp.mesh,
                         in_specs=(y_spec, tp.rules.param_spec(names, tp.mesh)),
                         out_specs=y_spec)(y, b)
