"""Layer-stack runners: how a segment of equal layers executes under its schedule.

A model hands the runtime its layers as pure functions of one layer's state (`LayerFns`) and
the stacked states; `run_stack` splits the stack into segments (`layer_plan.segments`) and runs
each under its rule set, projection strategy and remat policy with one of three runners
(`registry.RUNNERS`):

    scan              a scan over layers (or a Python loop); the projections carry any
                      communication (GSPMD, rings, PrimePar)
    manual_layer      each layer inside one shard_map, its sub-batches ordered by the step order
                      so one sub-batch's collective runs beside another's compute
    overlapped_stack  the whole segment inside one shard_map, sub-batches split from its first
                      layer to its last, each layer's last all-reduce completed in the next layer
                      (Oases' cross-layer overlap)

A pipeline runner joins these as a sibling, and so does the MoE group runner
(`oases_jax.moe.stack.run_groups`: a scan over groups of moe_every - 1 dense layers and one MoE
layer, carrying the router losses).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from oases_jax import compat, projections, registry, remat, step_order
from oases_jax.layer_plan import LayerSpec, segments
from oases_jax.rules import ShardingRules, constrain, get_rules, suspend_rules, use_rules

RESIDUAL = projections.RESIDUAL


@dataclasses.dataclass(frozen=True)
class LayerFns:
    """One layer as pure functions of its state (a pytree without the stacked `layers` axis).

    ops(state)           -> {"attn": f, "mlp": f}: the residual sub-layers, x <- x + f(x)
    defer(state)         -> g: the last step of the Oases order (an MLP) up to its collective,
                            g(x) = pending state for `complete`
    complete(pending)    -> the last step's output from `defer`'s state
    zero_pending(p0, st) -> a pending state that adds nothing (for the first layer), given a
                            zero partial sum p0 shaped and varying like a real one
    state_names(state)   -> the logical axis names of each leaf (for shard_map specs)
    """

    ops: Callable[[Any], dict[str, Callable[[jax.Array], jax.Array]]]
    defer: Callable[[Any], Callable[[jax.Array], Any]]
    complete: Callable[[Any], jax.Array]
    zero_pending: Callable[[jax.Array, Any], Any]
    state_names: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Segment:
    """How one run of equal layers executes: its schedule, rule set, mesh, sub-batches, remat."""

    layer: LayerSpec
    rules: ShardingRules
    mesh: Mesh
    axis: str = "tensor"
    bidirectional: bool = True

    @property
    def spec(self) -> registry.ScheduleSpec:
        return self.layer.spec

    @property
    def runner(self) -> str:
        return self.spec.runner(self.layer.sub_batches, self.mesh.shape.get(self.axis, 1))

    @property
    def order(self) -> step_order.StepOrder:
        if self.spec.sub_batches:
            return step_order.oases(self.layer.sub_batches)
        return step_order.sequential()

    def projection(self, manual: bool = False) -> projections.Projection:
        return projections.strategy_for(self.spec, self.rules, self.mesh, manual=manual,
                                        axis=self.axis, bidirectional=self.bidirectional)

    def wrap(self, f: Callable, in_scan: bool) -> Callable:
        """`f` under the segment's remat policy."""
        if self.layer.remat == "none":
            return f
        gathers = self.projection(manual=self.runner != "scan").gathers_in_column
        return jax.checkpoint(f, policy=remat.policy(self.layer.remat, gathers),
                              prevent_cse=not in_scan)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How a model's layers run: the mesh, the run's rule set, and one `LayerSpec` per layer
    (`layers`), or `default` for every layer."""

    mesh: Mesh
    rules: ShardingRules
    default: LayerSpec = LayerSpec()
    layers: tuple[LayerSpec, ...] | None = None
    moe: Any = None  # MoE models: how their MoE layers run (`oases_jax.moe.MoESetup`)

    def segments(self, n_layers: int, remat_default: str | None = None
                 ) -> list[tuple[int, int, Segment]]:
        if self.layers is not None:
            if len(self.layers) != n_layers:
                raise ValueError(f"plan has {len(self.layers)} layers, model {n_layers}")
            specs = self.layers
        else:
            d = self.default
            if remat_default is not None:
                d = dataclasses.replace(d, remat=remat_default)
            specs = (d,) * n_layers
        return [(a, b, self.segment(s)) for a, b, s in segments(specs)]

    def segment(self, layer: LayerSpec) -> Segment:
        rules = get_rules(layer.spec.rules_for(self.rules.name))
        return Segment(layer, rules, self.mesh)


_ACTIVE: contextvars.ContextVar[Parallel | None] = contextvars.ContextVar(
    "oases_jax_parallel", default=None)


def active() -> Parallel | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def use_parallel(parallel: Parallel):
    """Run the layer stacks traced inside this block as `parallel` says (rules active too)."""
    token = _ACTIVE.set(parallel)
    try:
        with use_rules(parallel.rules, parallel.mesh):
            yield parallel
    finally:
        _ACTIVE.reset(token)


def _at(stacked, i):
    return jax.tree.map(lambda a: a[i], stacked)


def _n_layers(stacked) -> int:
    return jax.tree.leaves(stacked)[0].shape[0]


def _local_specs(fns: LayerFns, state, seg: Segment, stacked: bool):
    """Per-leaf PartitionSpecs of a layer's state (`stacked`: with a leading, unsharded layers
    axis) for a layer-wide shard_map."""
    lead = (None,) if stacked else ()
    return jax.tree.map(lambda names: jax.P(*lead, *seg.rules.param_spec(names, seg.mesh)),
                        fns.state_names(state), is_leaf=lambda n: isinstance(n, tuple))


def _gather_shards(fns: LayerFns, state, seg: Segment):
    """One layer's parameters inside a layer-wide shard_map, gathered over every mesh axis but
    the segment's tensor axis (FSDP's all-gather, layer by layer; autodiff turns it into the
    gradients' reduce-scatter). Parameters enter the shard_map as sharded as they are stored."""

    def gather(names, sub):
        spec = seg.rules.param_spec(names, seg.mesh)

        def one(a):
            for dim, entry in enumerate(spec):
                axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
                other = tuple(ax for ax in axes if ax != seg.axis)
                if other and len(other) < len(axes):
                    raise ValueError(f"parameter dim {dim} of {names} is split over {axes}: a "
                                     f"layer-wide shard_map gathers only dims not also split "
                                     f"over {seg.axis!r}")
                if other:
                    a = jax.lax.all_gather(a, other, axis=dim, tiled=True)
            return a

        return jax.tree.map(one, sub)

    return jax.tree.map(gather, fns.state_names(state), state,
                        is_leaf=lambda n: isinstance(n, tuple))


def run_stack(fns: LayerFns, stacked, x_BLD: jax.Array, *, scan: bool = True,
              remat_default: str | None = None) -> jax.Array:
    """All layers of `stacked` (leading layers axis) on x under the active `Parallel`: each
    segment under its own rule set, projection strategy and remat policy, the residual stream
    resharded at segment boundaries. Without an active `Parallel` the layers run plainly."""
    parallel = active()
    n = _n_layers(stacked)
    if parallel is None:  # no mesh: every layer in order, under the remat policy asked for
        policy = remat.policy(remat_default or "none")

        def layer(x, state):
            return step_order.run(step_order.sequential(), x, fns.ops(state))

        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=not scan)
        return _scan(layer, stacked, x_BLD, scan)
    for start, end, seg in parallel.segments(n, remat_default):
        part = stacked if (start, end) == (0, n) else jax.tree.map(lambda a, s=start, e=end:
                                                                   a[s:e], stacked)
        with use_rules(seg.rules, seg.mesh):
            x_BLD = constrain(x_BLD, RESIDUAL)
            x_BLD = RUNNERS[seg.runner](seg, fns, part, x_BLD, scan)
        x_BLD = constrain(x_BLD, RESIDUAL)
    return x_BLD


def _scan(layer: Callable, stacked, x_BLD, scan: bool):
    """`layer(x, state)` over the stacked states: one lax.scan, or a Python loop."""

    def body(x, state):
        return layer(x, state), None

    if scan:
        return jax.lax.scan(body, x_BLD, stacked)[0]
    for i in range(_n_layers(stacked)):
        x_BLD = body(x_BLD, _at(stacked, i))[0]
    return x_BLD


def _run_scan(seg: Segment, fns: LayerFns, stacked, x_BLD, scan: bool):
    proj = seg.projection()

    def layer(x, state):
        with projections.use(proj):
            return step_order.run(seg.order, x, fns.ops(state),
                                  constrain=lambda y: constrain(y, RESIDUAL))

    return _scan(seg.wrap(layer, scan), stacked, x_BLD, scan)


def run_layer(seg: Segment, fns: LayerFns, state, x_BLD: jax.Array) -> jax.Array:
    """One layer (unstacked `state`) under `seg`: sub-batch schedules run it inside one
    shard_map (`manual_layer`), the others as in a scan."""
    if seg.runner == "scan":
        with projections.use(seg.projection()):
            return step_order.run(seg.order, x_BLD, fns.ops(state),
                                  constrain=lambda y: constrain(y, RESIDUAL))
    x_spec = seg.rules.act_spec(RESIDUAL, seg.mesh)

    def local(state, x):
        state = _gather_shards(fns, state, seg)
        with suspend_rules(), projections.use(seg.projection(manual=True)) as proj:
            return step_order.run(seg.order, x, fns.ops(state), before_step=proj.before_step,
                                  after_step=proj.after_step, settle=proj.settle)

    return jax.shard_map(local, mesh=compat.context_mesh(seg.mesh),
                         in_specs=(_local_specs(fns, state, seg, False), x_spec),
                         out_specs=x_spec)(state, x_BLD)


def _run_manual_layers(seg: Segment, fns: LayerFns, stacked, x_BLD, scan: bool):
    return _scan(seg.wrap(lambda x, st: run_layer(seg, fns, st, x), scan), stacked, x_BLD, scan)


def _run_overlapped(seg: Segment, fns: LayerFns, stacked, x_BLD, scan: bool):
    """The segment in one shard_map, overlapped across layers: the sub-batches stay split from
    the first layer to the last, and each layer leaves its last step's all-reduce (the MLP of
    the last sub-batch) pending; the next layer issues it while its first sub-batch's attention
    computes (`step_order.run_overlapped`). The last one completes after the stack."""
    order = seg.order
    x_spec = seg.rules.act_spec(RESIDUAL, seg.mesh)

    def layer(carry, state):
        xs, pending = carry
        state = _gather_shards(fns, state, seg)
        # A fresh order-pinning state for each traced layer.
        with projections.use(seg.projection(manual=True)) as proj:
            carry = step_order.run_overlapped(order, xs, pending, fns.ops(state),
                                              fns.defer(state), fns.complete,
                                              before_step=proj.before_step,
                                              after_step=proj.after_step,
                                              settle=proj.settle)
        return carry, None

    def local(stacked, x):
        with suspend_rules(), projections.use(seg.projection(manual=True)) as proj:
            xs = step_order.split(order, x)
            if scan:
                # Layer 0 gets an all-zero pending step (its all-reduce adds nothing), so the
                # carry keeps one structure and one scan runs every layer: no peeled first
                # layer, no sliced copy of the stacked parameters.
                x_last = xs[order.steps[-1].sub_batch]
                zero = fns.zero_pending(proj.zero_partial(x_last),
                                        _gather_shards(fns, _at(stacked, 0), seg))
                carry, _ = jax.lax.scan(seg.wrap(layer, True), (xs, zero), stacked)
            else:
                carry = (xs, None)
                for i in range(_n_layers(stacked)):
                    carry, _ = seg.wrap(layer, False)(carry, _at(stacked, i))
            xs, pending = carry
            return step_order.join(step_order.finish_pending(order, xs, pending, fns.complete))

    return jax.shard_map(local, mesh=compat.context_mesh(seg.mesh),
                         in_specs=(_local_specs(fns, _at(stacked, 0), seg, True), x_spec),
                         out_specs=x_spec)(stacked, x_BLD)


RUNNERS: dict[str, Callable] = {"scan": _run_scan, "manual_layer": _run_manual_layers,
                                "overlapped_stack": _run_overlapped}
assert tuple(RUNNERS) == registry.RUNNERS

