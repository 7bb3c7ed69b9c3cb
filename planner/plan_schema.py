"""The plan file's schema (docs/planner.md, "The plan file"): strict types, sizes within the sanity
caps, names from the registries (schedules, remat policies, rule sets, mesh axes, model fields),
and the checks across fields: micro-batches divide the batch, the rule set fits the mesh, primepar
runs on every layer or none, an MoE section goes with an MoE model and its expert axis, the layers
match the model."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

from pydantic import Field, create_model

from oases_jax.errors import UserError
from oases_jax.mesh import KNOWN_AXES
from oases_jax.models.config import CHOICES, SIZE_CAP, SIZE_CAPS, ModelConfig, field_kinds
from oases_jax.moe.schedules import MOE_SCHEDULES
from oases_jax.moe.stack import scan_schedules
from oases_jax.pipeline import registry as pipelines
from oases_jax.planner.search.dense import SCHEDULES
from oases_jax.remat import POLICIES as REMATS
from oases_jax.rules import RULE_SETS
from oases_jax.schema import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    MAX_SEQ_LEN,
    MAX_TOKENS_PER_STEP,
    NonNegativeFloat,
    PositiveFloat,
    Strict,
    Text,
    at_most,
    exactly,
    one_of,
)

FORMAT = "oases-jax-plan/1"
VERSION = 1  # plans without a version (written before it existed) are read as version 1
FIX = "plan again with scripts/plan.py (the plan format: docs/planner.md)"


class LayerEntry(Strict):
    """One layer's strategy (`LayerSpec.to_json`)."""

    schedule: one_of(SCHEDULES, "schedule")
    sub_batches: at_most(MAX_GLOBAL_BATCH) = 1
    remat: one_of(REMATS, "remat") = "none"


Mesh = Annotated[dict[one_of(KNOWN_AXES, "mesh axis"), at_most(MAX_DEVICES)],
                 Field(min_length=1)]


class CandidateEntry(Strict):
    """A plan the search also priced (`baselines`, `alternatives`): read, never run."""

    summary: str
    mesh: Mesh
    microbatches: at_most(MAX_GLOBAL_BATCH)
    step_s: NonNegativeFloat
    peak_memory_bytes: NonNegativeFloat
    exposed_comm_s: NonNegativeFloat


class PipelineEntry(Strict):
    """The stage section of a 3D plan (`planner.search.pipeline`): the schedule over the mesh's
    `stage` axis, layers and recompute ratios (k/n) per stage, chunks per stage."""

    schedule: one_of(pipelines.names(runnable=True), "pipeline schedule")
    stages: at_most(MAX_DEVICES)
    stage_layers: Annotated[list[at_most(SIZE_CAPS["n_layers"])], Field(min_length=1)]
    remat_ratios: list[Text]
    virtual_stages: at_most(64) = 1
    backward_ticks: at_most(8) = None  # ticks a stage's backward spans (None: the runtime's rule)
    fused_ticks: bool = None  # the fused tick table (None: the runtime's rule)
    split_head: bool = None  # the head split over the stages by vocabulary (None: off)
    predicted_pipeline_s: NonNegativeFloat = None
    predicted_stage_memory_bytes: list[NonNegativeFloat] = None
    exact: bool = None


class MoEEntry(Strict):
    """The MoE section of an MoE model's plan (`planner.search.moe`): the expert degree (the
    mesh's `expert` axis, 1 without one), how the MoE layers run (`oases_jax.moe.schedules`:
    `local` without an expert axis) and parm_s2's chunk count, with what the search predicted."""

    expert: at_most(MAX_DEVICES) = 1
    schedule: one_of(MOE_SCHEDULES, "MoE schedule")
    chunks: at_most(64) = 1
    predicted_moe_s: NonNegativeFloat = None
    predicted_moe_comm_s: NonNegativeFloat = None
    predicted_grad_reduce_s: NonNegativeFloat = None


def _model_field(f: dataclasses.Field) -> tuple[object, object]:
    """The schema of one ModelConfig field: sizes within their caps, positive finite scales,
    names from `CHOICES`; its dataclass default when the plan leaves it out."""
    kind, optional = field_kinds()[f.name]
    if kind is int:
        t = at_most(SIZE_CAPS.get(f.name, SIZE_CAP))
    elif kind is float:
        t = PositiveFloat
    elif f.name in CHOICES:
        t = one_of(CHOICES[f.name], f.name)
    else:
        t = kind
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return (t | None if optional else t), default


ModelConfigEntry = create_model(
    "ModelConfigEntry", __base__=Strict,
    **{f.name: _model_field(f) for f in dataclasses.fields(ModelConfig)})


class PlanFile(Strict):
    """Every field `planner.plan.plan_json` writes. Those a run reads are required (model or
    model_config may be absent for a plan that is not trained); the predictions are optional."""

    format: exactly(FORMAT, "format") = FORMAT
    version: exactly(VERSION, "version") = VERSION
    model: Text = None
    model_cfg: ModelConfigEntry = Field(None, alias="model_config")
    cluster: Text = None
    global_batch: at_most(MAX_GLOBAL_BATCH)
    seq_len: at_most(MAX_SEQ_LEN)
    mesh: Mesh
    rules: one_of(RULE_SETS, "rule set") = "tp"
    microbatches: at_most(MAX_GLOBAL_BATCH)
    layers: Annotated[list[LayerEntry], Field(min_length=1, max_length=SIZE_CAPS["n_layers"])]
    predicted_step_s: NonNegativeFloat = None
    predicted_peak_memory_bytes: NonNegativeFloat = None
    predicted_exposed_comm_s: NonNegativeFloat = None
    memory: dict[str, NonNegativeFloat] = None
    baselines: dict[str, CandidateEntry] = None
    search_s: NonNegativeFloat = None
    cost_source: Text = None
    alternatives: list[CandidateEntry] = None
    verified: dict = None  # `planner.verification.verify`'s record of the compiled candidates
    pipeline: PipelineEntry = None  # 3D plans only; absent: no pipeline
    moe: MoEEntry = None  # MoE models' plans only; absent: a dense plan
    provenance: dict = None  # `oases_jax.provenance.record()` of the command that wrote it


def check(p: PlanFile, where: str) -> ModelConfig | None:
    """The checks across fields; returns the plan's model (None when it names none)."""
    devices = math.prod(p.mesh.values())
    if devices > MAX_DEVICES:
        raise UserError(f"{where}: mesh {_mesh(p)} spans {devices:,} devices, more than "
                        f"{MAX_DEVICES:,} (a sanity cap); {FIX}")
    if p.global_batch * p.seq_len > MAX_TOKENS_PER_STEP:
        raise UserError(f"{where}: global_batch x seq_len = {p.global_batch * p.seq_len:,} "
                        f"tokens per step, more than {MAX_TOKENS_PER_STEP:,} (a sanity cap); {FIX}")
    if p.global_batch % p.microbatches:
        raise UserError(f"{where}: microbatches = {p.microbatches} does not divide global_batch "
                        f"{p.global_batch}; {FIX}")
    rows = p.global_batch // p.microbatches
    for i, layer in enumerate(p.layers):
        if layer.sub_batches > rows:
            raise UserError(f"{where}: layers[{i}].sub_batches = {layer.sub_batches} is more "
                            f"than the {rows} rows of a micro-batch; {FIX}")
    _check_primepar(p, where)
    _check_pipeline(p, where)
    _check_moe(p, where)
    _check_rules(p, where)
    return _check_model(p, where)


def _mesh(p: PlanFile) -> str:
    return ",".join(f"{k}={v}" for k, v in p.mesh.items())


def _check_primepar(p: PlanFile, where: str) -> None:
    """primepar shards every layer's parameters over its square, and stacked layers share one
    sharding: a plan runs primepar on every layer or on none, on a tp_row x tp_col square under
    its own rule set, which nothing else uses."""
    n = sum(s.schedule == "primepar" for s in p.layers)
    if n and n < len(p.layers):
        raise UserError(f"{where}: {n} of {len(p.layers)} layers run primepar; primepar stores "
                        "every layer's weights split over its tp_row x tp_col square, so a plan "
                        f"runs it on all layers or none; {FIX}")
    if n and (p.rules != "primepar" or not {"tp_row", "tp_col"} <= set(p.mesh)):
        raise UserError(f"{where}: primepar layers need rules 'primepar' and a mesh with tp_row "
                        f"and tp_col, not rules {p.rules!r} on {_mesh(p)}; {FIX}")
    if p.rules == "primepar" and not n:
        raise UserError(f"{where}: rules 'primepar' is primepar's own rule set, but no layer "
                        f"runs primepar; {FIX}")
    if n and p.mesh["tp_row"] != p.mesh["tp_col"]:
        raise UserError(f"{where}: mesh tp_row={p.mesh['tp_row']} x tp_col={p.mesh['tp_col']} "
                        f"is not square; primepar needs tp_row = tp_col; {FIX}")


def _check_pipeline(p: PlanFile, where: str) -> None:
    """A stage section and a `stage` mesh axis come together and agree; the stages' layers sum
    to the plan's layers, one ratio per stage."""
    stages = p.mesh.get("stage", 1)
    if p.pipeline is None:
        if stages > 1:
            raise UserError(f"{where}: mesh {_mesh(p)} has a stage axis but the plan has no "
                            f"pipeline section; {FIX}")
        return
    q = p.pipeline
    if q.stages != stages or len(q.stage_layers) != stages or len(q.remat_ratios) != stages:
        raise UserError(f"{where}: pipeline.stages = {q.stages} with {len(q.stage_layers)} "
                        f"stage_layers and {len(q.remat_ratios)} remat_ratios does not match the "
                        f"mesh's stage={stages}; {FIX}")
    if sum(q.stage_layers) != len(p.layers) or min(q.stage_layers) < 1:
        raise UserError(f"{where}: pipeline.stage_layers {q.stage_layers} must be positive and "
                        f"sum to the plan's {len(p.layers)} layers; {FIX}")


def _check_moe(p: PlanFile, where: str) -> None:
    """An MoE section and an `expert` mesh axis agree; the section runs `local` exactly when
    there is no expert axis, chunks only under parm_s2, under rules dp, tp or tp_sp, without a
    pipeline, and one dense strategy on every layer from those MoE layer groups run under."""
    expert = p.mesh.get("expert", 1)
    q = p.moe
    if q is None:
        if expert > 1:
            raise UserError(f"{where}: mesh {_mesh(p)} has an expert axis but the plan has no "
                            f"moe section; {FIX}")
        return
    problem = None
    if q.expert != expert:
        problem = f"moe.expert = {q.expert} but the mesh's expert axis is {expert}"
    elif MOE_SCHEDULES[q.schedule].needs_expert_axis != (expert > 1):
        problem = (f"moe.schedule = {q.schedule!r} on mesh {_mesh(p)}: 'local' runs without an "
                   "expert axis, the other MoE schedules on one")
    elif q.chunks > 1 and not MOE_SCHEDULES[q.schedule].chunked:
        chunked = [n for n, s in MOE_SCHEDULES.items() if s.chunked]
        problem = f"moe.chunks = {q.chunks}: only {', '.join(chunked)} runs in chunks"
    elif p.pipeline is not None:
        problem = "an MoE plan has a pipeline section: pipelines do not run MoE models yet"
    elif p.rules not in ("dp", "tp", "tp_sp"):
        problem = f"MoE models run under rules dp, tp or tp_sp, not {p.rules!r}"
    elif len({(s.schedule, s.sub_batches, s.remat) for s in p.layers}) > 1:
        problem = ("its layers differ: MoE plans run one dense strategy on every layer (the "
                   "runtime scans (dense..., MoE) layer groups under one segment)")
    elif p.layers[0].schedule not in scan_schedules():
        problem = (f"layers run {p.layers[0].schedule!r}; MoE layer groups run under "
                   f"{', '.join(s for s in scan_schedules() if s in SCHEDULES)}")
    if problem:
        raise UserError(f"{where}: {problem}; {FIX}")


def _rule_axes(name: str) -> set[str]:
    """The mesh axes a rule set splits anything over."""
    rules = RULE_SETS[name]()
    out: set[str] = set()
    for _, axes in (*rules.params, *rules.activations):
        out.update((axes,) if isinstance(axes, str) else axes or ())
    return out


def _check_rules(p: PlanFile, where: str) -> None:
    """Every mesh axis of more than one device is one the rule set splits over; the devices
    along any other would all compute the same thing."""
    used = _rule_axes(p.rules) | ({"stage"} if p.pipeline is not None else set())
    idle = [f"{a}={n}" for a, n in p.mesh.items() if n > 1 and a not in used]
    if idle:
        raise UserError(f"{where}: rules {p.rules!r} split nothing over mesh axis {idle[0]}, so "
                        f"its devices would all compute the same; use rules that split over "
                        f"{idle[0].split('=')[0]} ({', '.join(sorted(RULE_SETS))}) or drop the "
                        f"axis; {FIX}")


def _check_model(p: PlanFile, where: str) -> ModelConfig | None:
    """The plan's model (model_config, else the `model` preset) and its fit to the plan."""
    from oases_jax.models.presets import get_preset

    if p.model_cfg is not None:
        field, what = "model_config", "model_config.n_layers"
        try:
            cfg = ModelConfig(**p.model_cfg.model_dump())
        except UserError as e:
            raise UserError(f"{where}: model_config: {e}; {FIX}") from None
    elif p.model is not None:
        field, what = "model", f"model {p.model!r}'s n_layers"
        try:
            cfg = get_preset(p.model)
        except UserError as e:
            raise UserError(f"{where}: model: {e}, or give the plan's model_config") from None
    else:
        return None
    if len(p.layers) != cfg.n_layers:
        raise UserError(f"{where}: layers has {len(p.layers)} entries but {what} is "
                        f"{cfg.n_layers}; {FIX}")
    if cfg.moe and p.moe is None:
        raise UserError(f"{where}: {field} is a mixture of experts ({cfg.n_experts} experts) but "
                        f"the plan has no moe section (planned as a dense model); {FIX}")
    if not cfg.moe and p.moe is not None:
        raise UserError(f"{where}: the plan has a moe section but {field} is a dense model; {FIX}")
    if cfg.moe and cfg.n_experts % p.moe.expert:
        raise UserError(f"{where}: moe.expert = {p.moe.expert} does not divide {field}'s "
                        f"{cfg.n_experts} experts; {FIX}")
    if p.seq_len > cfg.max_seq_len:
        raise UserError(f"{where}: seq_len = {p.seq_len} is more than {field}'s max_seq_len "
                        f"{cfg.max_seq_len}; {FIX}")
    return cfg
