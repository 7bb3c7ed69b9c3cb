"""`parallelize()`: data, tensor and pipeline parallelism for a Flax NNX model this project did
not write, without changing it (Merak's non-intrusive API; docs/parallelize.md).

    run = parallelize(model, loss_fn, batch, mesh, plan="auto", optimizer=optax.adamw(1e-3))
    state = run.init(model)
    state, metrics = run.step(state, batch)
    run.update(model, state)  # the trained values back into the user's model

It finds the repeated block (`graph`), maps each block's linear layers to column or row
parallel over `tensor` (`tensor`), splits the blocks into contiguous stages over `stage` and
runs them with the project's pipeline executor and schedules (`step`), with the batch split
over `data`. `run.report()` says what it found and chose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.errors import UserError
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.pipeline.remat import ratio_text
from oases_jax.rules import get_rules
from oases_jax.stacks import Parallel, use_parallel
from oases_jax.training.parallelize import block, graph, step
from oases_jax.training.parallelize.tensor import logical_spec, map_block, names_of
from oases_jax.training.pipeline_layout import STAGE, PipelineSpec
from oases_jax.training.state import StepFns, assemble_step_fns, new_state, optimizer_update

__all__ = ["Plan", "Parallelized", "parallelize"]
AXES = ("data", "stage", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan(PipelineConfig):
    """How to pipeline: a `PipelineConfig` (schedule `gpipe`, `1f1b`, `interleaved` or `merak`;
    per-stage block counts, None: uniform; chunks per stage for `interleaved`, 0: its 2;
    Merak's stage-aware recompute ratios, `(0.8,)` or one per stage; the tick table) and M
    micro-batches per step (None: the "auto" rule), e.g. `Plan(schedule="gpipe",
    stage_layers=(3, 1), microbatches=4)`. A plan is the pipeline's config itself, so its
    fields read as the runtime's."""

    schedule: str = "1f1b"
    microbatches: int | None = None


def auto_microbatches(rows: int, stages: int) -> int:
    """The "auto" plan's M: the largest divisor of the rows each data group gets per step that
    is at most 2S (1F1B's bubble is (S-1)/(M+S-1): 2S micro-batches keep it under 1/3)."""
    return max(m for m in range(1, min(rows, 2 * stages) + 1) if rows % m == 0)


@dataclasses.dataclass(frozen=True, eq=False)
class Parallelized:
    """A user model made parallel: its train step, gradients and layouts."""

    mesh: Mesh
    plan: Plan  # the resolved plan (microbatches filled in)
    pipe: PipelineSpec
    blocks: graph.Blocks
    lines: tuple[str, ...]
    fns: StepFns
    grads_jit: Callable
    _model: Any  # (treedef of the model's state, where each leaf comes from)

    def report(self) -> str:
        return "\n".join(self.lines)

    def microbatches(self, batch):
        """A batch [B, ...] (any pytree) as [M, B/M, ...]."""
        M = self.plan.microbatches
        return jax.tree.map(lambda a: np.asarray(a).reshape(M, a.shape[0] // M, *a.shape[1:]),
                            batch)

    def init(self, model: nnx.Module, seed: int = 0) -> dict:
        """The train state (stage layout, sharded; optimizer state) from the model's values."""
        stacked, shared = _values(model, self.blocks, self._model)
        # Host copies: the step donates its state, which must not free the model's own arrays.
        params = {"blocks": [np.asarray(a) for a in step.to_stages(stacked, self.pipe)],
                  "shared": tuple(np.array(a) for a in shared)}
        params = jax.device_put(params, self.fns.state_shardings["params"])
        return new_state(params, self.fns, seed)

    def step(self, state: dict, batch) -> tuple[dict, dict]:
        """One optimizer step on a batch [B, ...]: (new state, {"loss", "grad_norm"})."""
        return self.fns.train_step(state, self.microbatches(batch))

    def grads(self, params: dict, batch) -> tuple[jax.Array, dict]:
        """(mean loss, mean gradients in the stage layout) of a batch [B, ...]."""
        with jax.set_mesh(self.mesh):
            return self.grads_jit(params, self.microbatches(batch))

    def model_state(self, params: dict) -> nnx.State:
        """Parameters (or gradients) in the stage layout as the model's own nnx.State."""
        treedef, where = self._model
        stacked = step.from_stages(params["blocks"], self.pipe)
        leaves = [np.asarray(params["shared"][k]) if layer is None and k is not None else
                  stacked[r] if layer is None else stacked[r][layer]
                  for (r, layer, k) in where]
        return jax.tree.unflatten(treedef, [jnp.asarray(a) for a in leaves])

    def update(self, model: nnx.Module, state: dict) -> None:
        """Write a train state's parameters back into the user's model."""
        nnx.update(model, self.model_state(state["params"]))


def _values(model, blocks: graph.Blocks, layout) -> tuple[list, list]:
    """The model's current block leaves stacked [L, ...] and its shared leaves."""
    treedef, where = layout
    leaves = jax.tree.leaves(nnx.state(model))
    n_block = max((r for r, layer, k in where if k is None), default=-1) + 1
    stacked: list = [None] * n_block
    per_layer: dict = {}
    shared = [None] * sum(k is not None for _, _, k in where)
    for leaf, (r, layer, k) in zip(leaves, where, strict=True):
        if k is not None:
            shared[k] = leaf
        elif layer is None:
            stacked[r] = leaf
        else:
            per_layer.setdefault(r, {})[layer] = leaf
    for r, rows in per_layer.items():
        stacked[r] = np.stack([np.asarray(rows[i]) for i in range(blocks.count)])
    return stacked, shared


def _layout(model, blocks: graph.Blocks, shared_paths: list[tuple]):
    """Where every leaf of the model's state comes from: (block leaf, layer, None) for a block
    leaf (layer None when the blocks are stacked), (None, None, k) for shared leaf k."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(model))
    block_rest = {graph.keys_of(p): r for r, (p, _) in enumerate(
        jax.tree_util.tree_flatten_with_path(blocks.state)[0])}
    shared_at = {p: k for k, p in enumerate(shared_paths)}
    n, where = len(blocks.path), []
    for p, _ in flat:
        keys = graph.keys_of(p)
        if keys[:n] != blocks.path:
            where.append((None, None, shared_at[keys]))
        elif blocks.stacked:
            where.append((block_rest[keys[n:]], None, None))
        else:
            where.append((block_rest[keys[n + 1:]], keys[n], None))
    return treedef, where


def _check_mesh(mesh: Mesh) -> Mesh:
    bad = [a for a in mesh.axis_names if a not in AXES]
    if bad:
        raise UserError(f"parallelize() runs on mesh axes {AXES}; the mesh has {bad}: build it "
                        f"with oases_jax.mesh.make_mesh('data=2,stage=2,tensor=2')")
    if STAGE in mesh.axis_names:
        return mesh
    devices = np.asarray(mesh.devices)[None]
    return Mesh(devices, (STAGE, *mesh.axis_names), axis_types=(mesh.axis_types[0],) * (
        devices.ndim))


def _microbatches(plan, rows: int, stages: int, groups: int) -> Plan:
    """The plan with M filled in and checked against the batch."""
    if isinstance(plan, str) and plan == "auto":
        plan = Plan()
    if not isinstance(plan, Plan):
        raise UserError(f"plan {plan!r} is not a parallelize.Plan; pass Plan(...) or 'auto'")
    per_group = rows // groups if rows % groups == 0 else 0
    if not per_group:
        raise UserError(f"the batch has {rows} rows, which do not split over data={groups}; "
                        f"use a batch size that is a multiple of {groups}")
    m = plan.microbatches or auto_microbatches(per_group, stages)
    if per_group % m:
        raise UserError(f"microbatches={m} does not divide the {per_group} rows each data group "
                        f"gets per step; pick a divisor of {per_group}")
    return dataclasses.replace(plan, microbatches=m)


def _resolve(plan: Plan, stages: int, layers: int) -> tuple[Plan, PipelineSpec]:
    """The plan's pipeline on S stages of `layers` blocks; the plan with its chunks filled in."""
    spec = pipelines.runnable(plan.schedule)
    if spec.executor != "ticks":
        raise UserError(f"parallelize() runs its stages with the tick executor: schedule "
                        f"{plan.schedule!r} is not one of its "
                        f"({', '.join(pipelines.names(executor='ticks'))})")
    # A user's block has no cost model to split a backward by, nor a head to split.
    if plan.backward_ticks > 1 or plan.split_head:
        flag = "backward_ticks" if plan.backward_ticks > 1 else "split_head"
        raise UserError(f"parallelize() runs every backward in one tick and the loss on the "
                        f"last stage; drop {flag}={getattr(plan, flag)!r} from the Plan")
    pipe = PipelineSpec.of(plan, stages=stages, microbatches=plan.microbatches,
                           num_layers=layers)
    plan = dataclasses.replace(plan, virtual_stages=pipe.chunks)
    return plan, dataclasses.replace(pipe, config=plan)


def _find(model, loss_fn, micro) -> tuple[graph.Blocks, graph.Cut]:
    found, why = graph.candidates(model)
    for blocks in found:
        cut = graph.cut_loss(model, blocks, loss_fn, micro, why)
        if cut is not None:
            return blocks, cut
    near = f" ({'; '.join(why)})" if why else ""
    raise UserError(f"parallelize() found no repeated block in {type(model).__name__}{near}: "
                    f"keep identical blocks in an nnx.List (or stack them with nnx.vmap and run "
                    f"them with nnx.scan) and call them as x = block(x) one after the other")


def _tensor_map(blocks, cut, mesh, apply) -> tuple[list, list[str], Callable]:
    """The block's tensor specs, report lines, and fn(layer leaves, x, side) running one
    block with Megatron's activation shardings (`tensor.run_block`)."""
    t = mesh.shape.get("tensor", 1)
    flat = jax.tree_util.tree_flatten_with_path(
        blocks.state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    sep = "." if blocks.stacked else "[*]."
    paths = [blocks.name + sep + ".".join(str(k) for k in graph.keys_of(p) if k != "value")
             for p, _ in flat]
    cut_lead = 1 if blocks.stacked else 0
    layer = [jax.ShapeDtypeStruct(v.get_value().shape[cut_lead:], v.get_value().dtype)
             for _, v in flat]
    side = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in cut.side.outs]
    tr = block.trace(apply, layer, cut.act, side)
    names = []
    for _, v in flat:
        n = names_of(v)
        names.append(n[1:] if n is not None and blocks.stacked and len(n) == v.get_value().ndim
                     else n)
    tm = map_block(paths, names, tr, t)

    def one(layer_leaves, x, side):
        return block.run(tr, tm.outputs, mesh, [*layer_leaves, x, *side])[0]

    return list(tm.specs), list(tm.lines), one


def _shared_specs(model, shared_paths, t: int) -> tuple[list, list[str]]:
    variables = {graph.keys_of(p): v for p, v in jax.tree_util.tree_flatten_with_path(
        nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable))[0]}
    specs, lines = [], []
    for p in shared_paths:
        v = variables[p[:-1]] if p[-1] == "value" else variables[p]
        name = ".".join(str(k) for k in p if k != "value")
        shape = v.get_value().shape
        names = names_of(v)
        if names is None:
            specs.append((None,) * len(shape))
            continue
        specs.append(logical_spec(name, names, shape, t))
        if any(specs[-1]):
            lines.append(f"{name} {shape}: split on dim {specs[-1].index('tensor')} "
                         f"(logical names {names})")
    return specs, lines


def parallelize(model: nnx.Module, loss_fn: Callable, batch, mesh: Mesh, plan: Plan | str = "auto",
                optimizer: optax.GradientTransformation | None = None) -> Parallelized:
    """Make `loss_fn(model, batch) -> scalar` (a mean over the batch's leading axis) run over
    `mesh` (axes data, stage, tensor): blocks pipelined over `stage` as `plan` says ("auto":
    1F1B, uniform stages, M = `auto_microbatches`), linear layers split over `tensor`, the batch
    over `data`. `batch`: an example batch (any pytree of arrays [B, ...]; only its shapes
    are used). Raises UserError (one line) on what it cannot do."""
    if not all(isinstance(v, nnx.Param) for _, v in nnx.iter_graph(model)
               if isinstance(v, nnx.Variable)):
        raise UserError("parallelize() trains nnx.Param variables only; the model holds other "
                        "variables (batch statistics, caches or RNG state): remove them")
    mesh = _check_mesh(mesh)
    rows = {a.shape[0] for a in jax.tree.leaves(batch)}
    if len(rows) != 1:
        raise UserError(f"batch leaves have leading sizes {sorted(rows)}; every leaf must be "
                        f"[B, ...] with one B")
    B, S, groups = rows.pop(), mesh.shape[STAGE], mesh.shape.get("data", 1)
    plan = _microbatches(plan, B, S, groups)
    micro = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        (B // groups // plan.microbatches, *a.shape[1:]), a.dtype), batch)
    gd, st = nnx.split(model)  # the user's own errors first, as they are
    jax.eval_shape(lambda st, b: loss_fn(nnx.merge(gd, st), b), st, micro)
    blocks, cut = _find(model, loss_fn, micro)
    plan, pipe = _resolve(plan, S, blocks.count)
    gd_leaves = jax.tree.structure(blocks.state)
    apply = step.block_call(blocks.graphdef, gd_leaves, cut.call)
    block_specs, lines, one = _tensor_map(blocks, cut, mesh, apply)
    shared_paths = list(cut.shared_paths)
    shared_specs, shared_lines = _shared_specs(model, shared_paths, mesh.shape.get("tensor", 1))
    prog = step.stage_program(cut, step.layer_stack(one), pipe, cut.act)
    p_sh = step.shardings(mesh, block_specs, shared_specs)
    stacked, shared = _values(model, blocks, _layout(model, blocks, shared_paths))
    abstract = jax.eval_shape(lambda s, h: {"blocks": step.to_stages(s, pipe), "shared": tuple(h)},
                              stacked, shared)
    grads = step.grads_fn(mesh, pipe, prog, groups)
    parallel = Parallel(mesh, get_rules("tp"))
    tx = optimizer or optax.adamw(1e-3)
    batch_sh = NamedSharding(mesh, P(None, "data") if groups > 1 else P())

    def train_step(state, batch_M):
        loss, g = grads(state["params"], batch_M)
        return optimizer_update(tx, state, g, {"loss": loss})

    fns = assemble_step_fns(parallel, tx, abstract_params=abstract, p_sh=p_sh,
                            batch_sh=batch_sh, train_step=train_step,
                            evaluate=lambda p, b: grads(p, b)[0])

    def traced(p, b):
        with use_parallel(parallel):
            return grads(p, b)

    with jax.set_mesh(mesh):
        grads_jit = jax.jit(traced, in_shardings=(p_sh, batch_sh))
    summary = [f"blocks: {blocks.name}, {blocks.count} x {type(_node(model, blocks.path)).__name__}"
               f" ({'stacked' if blocks.stacked else 'list'}), "
               f"{blocks.size // blocks.count:,} parameters each",
               f"mesh: {dict(mesh.shape)}; plan: {plan.schedule}, M={plan.microbatches}, "
               f"stage layers {list(pipe.layers)}"
               + (f", remat ratios {', '.join(map(ratio_text, plan.remat_ratios))}"
                  if plan.remat_ratios else ""),
               "tensor parallel (per block):"] + ["  " + x for x in lines]
    summary += ["shared parameters: replicated over stage and tensor"
                + ("" if not shared_lines else "; except:")] + ["  " + x for x in shared_lines]
    # Shapes only from here: the run must not keep the model's initial arrays alive.
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), blocks.state)
    return Parallelized(mesh, plan, pipe, dataclasses.replace(blocks, state=shapes),
                        tuple(summary), fns, grads_jit, _layout(model, blocks, shared_paths))


def _node(model, path):
    node = model
    for k in path:
        node = node[k] if isinstance(k, int) else getattr(node, k)
    return node[0] if isinstance(node, (list, tuple, nnx.List)) else node
