"""Projection strategies: how the column (D -> heads/mlp) and row (heads/mlp -> D) projections of a
layer run under a schedule, as objects.

Models call the module functions `column`, `row`, `add_bias`, `row_partial` and `complete` with
logical names for the weights; they delegate to the strategy active for the segment of layers
being traced (`use`). Strategies (`registry.PROJECTIONS`; docs/parallelism.md):

    Gspmd           plain einsums; GSPMD inserts Megatron's all-reduces
    GspmdPinned     plain einsums with the model dimension pinned around them (XLA's own
                    windowed einsum rewrites these)
    PerProjection   one shard_map per projection over a per-device strategy:
      LocalSeq      Megatron-SP: the sequence-sharded residual stream is all-gathered before the
                    column projections and the row projections' sums reduce-scattered onto it
      LocalRing     ppermute rings overlapping each chunk's GEMM
    PrimePar        Cannon-style projections on the tp_row x tp_col square
    LocalAllReduce  inside a layer-wide shard_map: local partial sums, explicit all-reduces, and
                    the hooks the sub-batch executor uses to order them (Oases)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from oases_jax import compat, primepar, step_order
from oases_jax.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from oases_jax.registry import ScheduleSpec
from oases_jax.rules import Logical, ShardingRules, constrain

RESIDUAL: Logical = ("batch", "seq", "embed")


def _flat(w: jax.Array, n_in: int) -> jax.Array:
    return w.reshape(math.prod(w.shape[:n_in]), -1)


def _split_outputs(y: jax.Array, flat: Sequence[jax.Array], ws: Sequence[jax.Array]):
    """Undo the concatenation of several column weights: y [..., sum(F_i)] -> [..., *out_i]."""
    cuts = [sum(f.shape[1] for f in flat[: i + 1]) for i in range(len(flat) - 1)]
    parts = jnp.split(y, cuts, axis=-1)
    return tuple(p.reshape(*p.shape[:2], *w.shape[1:]) for p, w in zip(parts, ws, strict=True))


def einsum_row(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [B, L, *in] @ w [*in, D] on the arrays at hand."""
    letters = "ijkm"[: w.ndim - 1]
    return jnp.einsum(f"bl{letters},{letters}d->bld", h, w)


def bias_add(y: jax.Array, b: jax.Array) -> jax.Array:
    """y + b for y [..., N] and a bias b [N] of y's dtype. The bias gradient is summed in a
    fusion of its own, over dy as the backward writes it anyway: fused into dy's producer
    (GELU's backward), the column reduction kept XLA from fusing the tanh there, which it wrote
    to memory and read back instead (three passes over the [B, L, F] hidden per layer)."""
    # Inside shard_map the gradient sums over the axes y varies over and b does not; known
    # now, so the backward saves nothing (a saved bias would be a pipeline residual).
    extra = tuple(sorted(compat.varying_axes(y) - compat.varying_axes(b)))
    return _bias_add(y, b, extra)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bias_add(y, b, extra):
    return y + b


def _bias_add_fwd(y, b, extra):
    return y + b, None


def _bias_add_bwd(extra, _, dy):
    db = jax.lax.optimization_barrier(dy).sum(tuple(range(dy.ndim - 1)))
    return dy, jax.lax.psum(db, extra) if extra else db


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


class Projection:
    """The interface every strategy implements. Its own methods are plain einsums on whatever
    arrays they are given, which GSPMD partitions outside shard_map."""

    gathers_in_column = False  # the column projection's outputs are not post-collective values

    def column(self, x_BLD, weights, names) -> list[jax.Array]:
        return [jnp.einsum("bld,d...->bl...", x_BLD, w) for w in weights]

    def row(self, h, w, names) -> jax.Array:
        return einsum_row(h, w)

    def add_bias(self, y, b, names) -> jax.Array:
        """y + b over the output's flattened trailing dims (q/k/v: heads x head_dim), which is
        the GEMM's own [B*L, N] output: XLA folds a vector bias into the GEMM's epilogue there,
        but not a [H, K] one broadcast over a [B, L, H, K] view (two more passes over y)."""
        lead = y.shape[:y.ndim - b.ndim]
        return bias_add(y.reshape(*lead, -1), b.reshape(-1).astype(y.dtype)).reshape(y.shape)

    def row_partial(self, h, w) -> jax.Array:
        return einsum_row(h, w)

    def complete(self, partial) -> jax.Array:
        return partial

    # Hooks of the sub-batch executor (`step_order.run`): nothing to order outside shard_map.
    def before_step(self, x):
        return x

    def after_step(self, x) -> None:
        return None

    def settle(self, x):
        return x


class Gspmd(Projection):
    """Plain einsums: the partitioner inserts whatever collectives the shardings need."""


class GspmdPinned(Projection):
    """Plain einsums whose model dimension is pinned: each column projection's output and each
    row projection's input stay sharded on heads / mlp. Without the pin GSPMD may compute the
    backward of a row projection (dH = dY W^T) by passing W around the ring rather than the
    sequence-sharded dY, which XLA's windowed-einsum pass cannot rewrite (it aborts on a cycle,
    docs/xla_estimate.md); with it the partitioner always moves the activation."""

    def column(self, x_BLD, weights, names) -> list[jax.Array]:
        return [constrain(y, ("batch", None, *n[1:])) for y, n in
                zip(super().column(x_BLD, weights, names), names, strict=True)]

    def row(self, h, w, names) -> jax.Array:
        return einsum_row(constrain(h, ("batch", None, *names[:-1])), w)


class PerProjection(Projection):
    """Each projection in its own shard_map, running the per-device strategy `local` on the
    blocks: the sequence-sharded residual stream goes in, the column outputs come out sharded
    on their heads / mlp names, and the row output goes back onto the sequence."""

    def __init__(self, local: Projection, rules: ShardingRules, mesh: Mesh):
        self.local, self.rules, self.mesh = local, rules, mesh
        self.gathers_in_column = local.gathers_in_column

    def column(self, x_BLD, weights, names) -> list[jax.Array]:
        rules, mesh = self.rules, self.mesh
        x_spec = rules.act_spec(RESIDUAL, mesh)
        w_specs = [rules.param_spec(n, mesh) for n in names]
        out_specs = tuple(rules.act_spec(("batch", None, *n[1:]), mesh) for n in names)
        outs = jax.shard_map(lambda x, *ws: tuple(self.local.column(x, ws, names)),
                             mesh=compat.context_mesh(mesh), in_specs=(x_spec, *w_specs),
                             out_specs=out_specs)(x_BLD, *weights)
        return list(outs)

    def row(self, h, w, names) -> jax.Array:
        rules, mesh = self.rules, self.mesh
        h_spec = rules.act_spec(("batch", None, *names[:-1]), mesh)
        return jax.shard_map(lambda h, w: self.local.row(h, w, names),
                             mesh=compat.context_mesh(mesh),
                             in_specs=(h_spec, rules.param_spec(names, mesh)),
                             out_specs=rules.act_spec(RESIDUAL, mesh))(h, w)


class LocalSeq(Projection):
    """Megatron-SP (Korthikanti et al.) on per-device blocks, inside a shard_map over `axis`:
    the column projections' input is all-gathered over the sequence once (their backward
    reduce-scatters its gradient), and the row projection's partial sums are reduce-scattered
    back onto the sequence (their backward all-gathers the gradient). Nothing else crosses
    devices: attention runs on whole sequences of the local heads."""

    gathers_in_column = True  # the gathered input is what `save_proj` keeps (`attn_in` too)

    def __init__(self, axis: str = "tensor"):
        self.axis = axis

    def column(self, x_BLD, weights, names) -> list[jax.Array]:
        x_BLD = jax.lax.all_gather(x_BLD, self.axis, axis=1, tiled=True)
        return super().column(x_BLD, weights, names)

    def row(self, h, w, names) -> jax.Array:
        return jax.lax.psum_scatter(einsum_row(h, w), self.axis, scatter_dimension=1,
                                    tiled=True)


class LocalRing(Projection):
    """The ring projections on per-device blocks, inside a shard_map over `axis`."""

    gathers_in_column = True

    def __init__(self, axis: str = "tensor", bidirectional: bool = True):
        self.axis, self.bidirectional = axis, bidirectional

    def column(self, x_BLD, weights, names) -> list[jax.Array]:
        """One all-gather ring for all weights (concatenated), split again."""
        bidirectional = self.bidirectional and x_BLD.shape[1] % 2 == 0
        flat = [_flat(w, 1) for w in weights]
        y = all_gather_matmul(x_BLD, jnp.concatenate(flat, axis=1), self.axis, bidirectional)
        return list(_split_outputs(y, flat, weights))

    def row(self, h, w, names) -> jax.Array:
        bidirectional = self.bidirectional and w.shape[-1] % 2 == 0
        return matmul_reduce_scatter(h.reshape(*h.shape[:2], -1), _flat(w, w.ndim - 1),
                                     self.axis, bidirectional)


class _LocalOrdered(Projection):
    """Megatron's projections inside a layer-wide shard_map, with explicit collectives over
    `axis` and the hooks the sub-batch executor uses to keep one sub-batch's collectives beside
    another's compute, forward and backward. A subclass says how the column projections'
    input enters (`_enter`: its transpose is the backward's dX collective) and how the row
    projection's partial sums leave (`_reduce`). Holds per-trace state: build one per traced
    layer."""

    enters_with_collective = False  # `_enter` gathers: the input's collective starts a step

    def __init__(self, axis: str = "tensor"):
        self.axis = axis
        self._partials: list[jax.Array] = []  # row partials produced since the last step
        self._anchor: jax.Array | None = None  # the output of the last executed step
        self._tied: tuple | None = None  # (the last step's output, as `column` tied it)
        self._last_y: jax.Array | None = None  # the last row projection's collective result

    def _enter(self, x_BLD) -> jax.Array:
        raise NotImplementedError

    def _reduce(self, partial) -> jax.Array:
        raise NotImplementedError

    def zero_partial(self, x_sub: jax.Array) -> jax.Array:
        """A zero row partial for a sub-batch whose residual is `x_sub`, shaped and varying
        over `axis` like a real one (check_vma): an overlapped stack's first pending step."""
        shape = self._partial_shape(x_sub.shape)
        axes = tuple(sorted(compat.varying_axes(x_sub) | {self.axis}))
        return jax.lax.pcast(jnp.zeros(shape, x_sub.dtype), axes, to="varying")

    def _partial_shape(self, shape) -> tuple[int, ...]:
        return tuple(shape)

    def column(self, x_BLD, weights, names) -> list[jax.Array]:
        """The column GEMMs on x as `_enter` gives it, tied to the previous step's output
        (`step_order.tie_backward`): in the backward the previous step's work starts only once
        this step's dX partial (the cotangent of what `_enter` returned) is computed, so this
        step's dX collective runs beside it."""
        xv = self._enter(x_BLD)
        if self.enters_with_collective:
            xv = self._after_partials(xv)
        if self._anchor is not None:
            untied = self._tied[0] if self._tied else self._anchor
            self._anchor, xv = step_order.tie_backward(self._anchor, xv)
            self._tied = (untied, self._anchor)
        return super().column(xv, weights, names)

    def settle(self, x):
        """The previous step's output as `column` tied it (`step_order.run`'s hook)."""
        if self._tied and x is self._tied[0]:
            return self._tied[1]
        return x

    def row(self, h, w, names) -> jax.Array:
        if self.enters_with_collective and self._last_y is not None:
            # The previous step's reduce-scatter ends before this step's row GEMM: XLA then
            # issues it beside this step's compute, not after it (where it left it exposed).
            h = step_order.pin((self._last_y, h))[1]
        partial = einsum_row(h, w)
        self._partials.append(partial)
        y = self._reduce(partial)
        self._last_y = y
        if self._anchor is None:
            return y
        # Use the collective's result only after the previous step's output: XLA would
        # otherwise fuse the residual adds of two sub-batches into one multi-output fusion
        # (they share the bias), which waits for both collectives and so serialises the second
        # behind the first.
        return step_order.pin((self._anchor, y))[1]

    def complete(self, partial) -> jax.Array:
        """The collective of a `row_partial`. Not tied to the last step's output: an overlapped
        stack completes it while other sub-batches' steps run, and a tie to one of them would
        serialise that step's own collective behind it."""
        return self._reduce(partial)

    def before_step(self, x):
        """Make `x` (the next step's input) available only once the partials produced so far
        are computed: XLA may then not hoist the next sub-batch's compute above the previous
        one's projection, so the previous collective keeps compute to hide behind. Where the
        input enters through a collective, the pin is on what it gathered instead (`column`),
        so that collective may run beside the previous step's compute."""
        return x if self.enters_with_collective else self._after_partials(x)

    def _after_partials(self, x):
        partials, self._partials = self._partials, []
        if not partials:
            return x
        return step_order.pin((*partials, x))[-1]

    def after_step(self, x) -> None:
        self._anchor, self._tied = x, None


class LocalAllReduce(_LocalOrdered):
    """Megatron (Oases' sub-batches): the column input made varying over `axis` explicitly
    (that cast's transpose is the backward's dX all-reduce), the row partials all-reduced."""

    def _enter(self, x_BLD) -> jax.Array:
        return jax.lax.pcast(x_BLD, (self.axis,), to="varying")

    def _reduce(self, partial) -> jax.Array:
        return jax.lax.psum(partial, self.axis)


class LocalSeqOrdered(_LocalOrdered):
    """Megatron-SP (`oases_sp`'s sub-batches): the sequence-sharded input all-gathered over
    `axis` before the column projections (the backward reduce-scatters dX), the row partials
    reduce-scattered back onto the sequence (the backward all-gathers dY)."""

    gathers_in_column = True  # the gathered input is what `save_proj` keeps (as `LocalSeq`)
    enters_with_collective = True

    def __init__(self, axis: str = "tensor", size: int = 1):
        super().__init__(axis)
        self.size = size  # devices on `axis`

    def _enter(self, x_BLD) -> jax.Array:
        return jax.lax.all_gather(x_BLD, self.axis, axis=1, tiled=True)

    def _partial_shape(self, shape) -> tuple[int, ...]:
        b, length, *rest = shape  # the partial holds the whole sequence
        return (b, length * self.size, *rest)

    def _reduce(self, partial) -> jax.Array:
        return jax.lax.psum_scatter(partial, self.axis, scatter_dimension=1, tiled=True)


class PrimePar(Projection):
    """Projections on the `rows` x `cols` square (oases_jax.primepar): column projections return
    the skewed layout that row projections take; `add_bias` adds a bias in it."""

    gathers_in_column = True

    def __init__(self, rules: ShardingRules, mesh: Mesh, rows: str = "tp_row",
                 cols: str = "tp_col"):
        primepar.square_size(mesh.shape, rows, cols)
        self.rules, self.mesh, self.rows, self.cols = rules, mesh, rows, cols

    def column(self, x_BLD, weights, names) -> list[jax.Array]:
        rules, mesh = self.rules, self.mesh
        x_spec = rules.act_spec(RESIDUAL, mesh)
        w_specs = [rules.param_spec(n, mesh) for n in names]
        out_specs = tuple(rules.act_spec(("batch", None, *n[1:]), mesh) for n in names)

        def local(x, *ws):  # x: X[i, j] [B/(dp q), L, D/q]; ws: stored blocks W[j, i+j-1]
            flat = [_flat(w, 1) for w in ws]
            y = primepar.column_matmul(x, jnp.concatenate(flat, axis=1), self.rows, self.cols)
            return _split_outputs(y, flat, ws)  # skewed: Y[i, i+j]

        outs = jax.shard_map(local, mesh=compat.context_mesh(mesh), in_specs=(x_spec, *w_specs),
                             out_specs=out_specs)(x_BLD, *weights)
        return list(outs)

    def row(self, h, w, names) -> jax.Array:
        rules, mesh, n_in = self.rules, self.mesh, w.ndim - 1

        def local(h, w):  # h: skewed X[i, i+j]; w: stored block W[i+j, j]
            return primepar.row_matmul(h.reshape(*h.shape[:2], -1), _flat(w, n_in), self.rows,
                                       self.cols)

        return jax.shard_map(local, mesh=compat.context_mesh(mesh),
                             in_specs=(rules.act_spec(("batch", None, *names[:-1]), mesh),
                                       rules.param_spec(names, mesh)),
                             out_specs=rules.act_spec(RESIDUAL, mesh))(h, w)

    def add_bias(self, y, b, names) -> jax.Array:
        """Device (i, j) holds output block i+j, so the bias blocks are skewed too: one small
        ppermute, no gather."""
        y_spec = self.rules.act_spec(("batch", None, *names), self.mesh)

        def local(y, b):  # b: block j of the bias, the same on every row
            return y + primepar.skew(b, self.rows, self.cols)

        return jax.shard_map(local, mesh=compat.context_mesh(self.mesh),
                             in_specs=(y_spec, self.rules.param_spec(names, self.mesh)),
                             out_specs=y_spec)(y, b)


def strategy_for(spec: ScheduleSpec, rules: ShardingRules, mesh: Mesh, *, manual: bool = False,
                 axis: str = "tensor", bidirectional: bool = True) -> Projection:
    """The projection strategy of schedule `spec` on `mesh` (`manual`: inside a layer-wide
    shard_map). Without a split to overlap (an axis of size 1) every strategy is plain GSPMD."""
    if manual:
        kind = spec.manual_projection
        if kind == "manual":
            return LocalAllReduce(axis)
        if kind == "seq_manual":
            return LocalSeqOrdered(axis, mesh.shape.get(axis, 1))
        if kind == "ring":
            return LocalRing(axis, bidirectional)
        raise ValueError(f"schedule {spec.name} has no manual projection")
    if spec.projection == "primepar" and mesh.shape.get("tp_row", 1) > 1:
        return PrimePar(rules, mesh)
    if mesh.shape.get(axis, 1) > 1 and spec.projection == "ring":
        return PerProjection(LocalRing(axis, bidirectional), rules, mesh)
    if mesh.shape.get(axis, 1) > 1 and spec.projection == "seq_parallel":
        return PerProjection(LocalSeq(axis), rules, mesh)
    if spec.projection == "gspmd_pinned":
        return GspmdPinned()
    return Gspmd()


_ACTIVE: contextvars.ContextVar[Projection | None] = contextvars.ContextVar(
    "oases_jax_projection", default=None)
_PLAIN = Gspmd()


def active() -> Projection:
    """The strategy of the segment being traced (plain einsums outside any)."""
    return _ACTIVE.get() or _PLAIN


@contextlib.contextmanager
def use(projection: Projection):
    """Run the projections traced inside this block with `projection`."""
    token = _ACTIVE.set(projection)
    try:
        yield projection
    finally:
        _ACTIVE.reset(token)


# What models call.


def column(x_BLD: jax.Array, weights: Sequence[jax.Array], names: Sequence[Logical]
           ) -> list[jax.Array]:
    """[x @ w for w in weights], each w of shape [D, *out] named ("embed", *out_names); the
    outputs are [B, L, *out]."""
    return active().column(x_BLD, weights, names)


def row(h: jax.Array, w: jax.Array, names: Logical) -> jax.Array:
    """h [B, L, *in] @ w [*in, D] -> [B, L, D], w named (*in_names, "embed")."""
    return active().row(h, w, names)


@jax.named_scope("bias")
def add_bias(y: jax.Array, b: jax.Array, names: Logical) -> jax.Array:
    """y + b for a column projection's output y [B, L, *out] and its bias b named `names`, in
    whatever layout the projection left y (primepar: skewed)."""
    return active().add_bias(y, b, names)


def row_partial(h: jax.Array, w: jax.Array) -> jax.Array:
    """This device's partial sum of a row projection, its collective left to `complete` (an
    overlapped stack issues it in the next layer)."""
    return active().row_partial(h, w)


def complete(partial: jax.Array) -> jax.Array:
    return active().complete(partial)
