"""Plans as plain JSON: what the search chose, what it predicts, and what it beat.

    {"format": "oases-jax-plan/1", "version": 1, "model": "small", "model_config": {...},
     "cluster": "cpu-8", "global_batch": 16, "seq_len": 128,
     "mesh": {"data": 2, "tensor": 4}, "rules": "tp", "microbatches": 1,
     "layers": [{"schedule": "oases", "sub_batches": 2, "remat": "none"}, ...],
     "predicted_step_s": ..., "predicted_peak_memory_bytes": ..., "predicted_exposed_comm_s": ...,
     "memory": {...}, "baselines": {"megatron": {...}, "best_uniform": {...}},
     "search_s": ..., "cost_source": "datasheet" | "profile", "alternatives": [...],
     "verified": {...},  # with `plan.py --verify N` only (`planner.verification.verify`)
     "moe": {"expert": 2, "schedule": "parm_s2", "chunks": 2, ...}}  # MoE models only

An MoE model's plan (`planner.search.moe`) gains the `moe` section: the expert degree (the mesh's
`expert` axis), the MoE schedule and its chunk count; its layers all run one dense strategy.

`load` and `from_json` validate a plan against its schema (`planner.plan_schema`) before anything
runs: every problem is one UserError line naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

from oases_jax.cli import write_atomic
from oases_jax.errors import UserError
from oases_jax.files import read_json
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.pipeline.remat import resolve_stage_layers
from oases_jax.planner.plan_schema import FIX, FORMAT, VERSION, PipelineEntry, PlanFile, check
from oases_jax.planner.search.dense import Candidate, SearchResult
from oases_jax.planner.search.pipeline import PipelineCandidate
from oases_jax.schema import validate

if TYPE_CHECKING:  # the compile path loads Flax and optax: only when a plan is compiled
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

def candidate_plan(c: Candidate) -> dict:
    """The fields of a plan a run reads, for a candidate of either search (an MoE candidate,
    `planner.search.moe.MoECandidate`, adds its `moe` section)."""
    d = {"global_batch": c.layout.global_batch, "seq_len": c.layout.seq_len,
         "mesh": c.layout.mesh(), "rules": c.layout.rules(),
         "microbatches": c.layout.microbatches, "layers": [s.to_json() for s in c.strategies]}
    moe = getattr(c, "moe", None)
    if moe is not None:
        d["moe"] = {"expert": c.layout.expert, "schedule": moe.schedule, "chunks": moe.chunks,
                    "predicted_moe_s": c.step.moe_s, "predicted_moe_comm_s": c.step.moe_comm_s,
                    "predicted_grad_reduce_s": c.step.reduce_s}
    return d


def candidate_json(c: Candidate) -> dict:
    return {"summary": c.summary(), "mesh": c.layout.mesh(), "microbatches": c.layout.microbatches,
            "step_s": c.cost.step_s, "peak_memory_bytes": c.cost.peak_memory_bytes,
            "exposed_comm_s": c.cost.exposed_comm_s}


def plan_json(result: SearchResult, *, model: str, cfg: ModelConfig, cluster: str,
              cost_source: str, alternatives: int = 5, best: Candidate | None = None) -> dict:
    """The plan of `best` (default: the search's best) with what it predicts and beat; the
    alternatives are the next-ranked other plans."""
    best = best or result.best
    others = [c for c in result.ranked if c is not best]
    run = candidate_plan(best)
    config = dataclasses.asdict(cfg)
    if "moe" in run:  # an MoE plan's one remat policy is its model's (`Plan.run_model`)
        config["remat"] = best.strategies[0].remat
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "model_config": config,
        "cluster": cluster,
        **run,
        "predicted_step_s": best.cost.step_s,
        "predicted_peak_memory_bytes": best.cost.peak_memory_bytes,
        "predicted_exposed_comm_s": best.cost.exposed_comm_s,
        "memory": best.cost.memory,
        "baselines": {k: candidate_json(v) for k, v in result.baselines.items()},
        "search_s": result.search_s,
        "cost_source": cost_source,
        "alternatives": [candidate_json(c) for c in others[:alternatives]],
    }


def pipeline_plan_json(c: PipelineCandidate, *, model: str, cfg: ModelConfig, cluster: str,
                       cost_source: str, search_s: float,
                       alternatives: Sequence[PipelineCandidate] = ()) -> dict:
    """A 3D plan (`planner.search.pipeline`): every layer runs the candidate's strategy, remat
    comes from the stage section's per-stage ratios (k/n, the first k layers), so the model
    config's own remat is none."""
    sp = c.stage_plan
    return {
        "format": FORMAT, "version": VERSION, "model": model,
        "model_config": {**dataclasses.asdict(cfg), "remat": "none"},
        "cluster": cluster, "global_batch": c.layout.global_batch, "seq_len": c.layout.seq_len,
        "mesh": c.mesh(), "rules": c.rules(),
        "microbatches": c.layout.microbatches,
        "layers": [c.strategy.to_json()] * cfg.n_layers,
        "pipeline": pipeline_entry(
            PipelineConfig(schedule=sp.schedule, stage_layers=sp.layers,
                           virtual_stages=sp.chunks, remat_ratios=sp.ratios,
                           backward_ticks=sp.backward_ticks, fused_ticks=sp.fused_ticks,
                           split_head=sp.split_head),
            stages=sp.stages, num_layers=cfg.n_layers, predicted_pipeline_s=sp.makespan,
            predicted_stage_memory_bytes=list(sp.memory), exact=sp.exact),
        "predicted_step_s": c.step_s, "predicted_peak_memory_bytes": c.peak_memory_bytes,
        "search_s": search_s, "cost_source": cost_source,
        "alternatives": [{"summary": a.summary(), "mesh": a.mesh(),
                          "microbatches": a.layout.microbatches, "step_s": a.step_s,
                          "peak_memory_bytes": a.peak_memory_bytes, "exposed_comm_s": 0.0}
                         for a in alternatives],
    }


def pipeline_entry(config: PipelineConfig, *, stages: int, num_layers: int,
                   predicted_pipeline_s: float | None = None,
                   predicted_stage_memory_bytes: Sequence[float] | None = None,
                   exact: bool | None = None) -> dict:
    """A pipeline config as a plan's stage section (`plan_schema.PipelineEntry`) on S stages of
    a model of `num_layers` layers: every stage's layers and recompute ratio written out (the
    uniform split, Merak's rule from r0, 0 without ratios), the chunks per stage, the tick table
    (absent fields: the runtime's rule), and what the search predicted."""
    chunks = pipelines.get(config.schedule).check_chunks(config.virtual_stages)
    ratios = config.ratios_for(stages) or (Fraction(0),) * stages
    entry = {"schedule": config.schedule, "stages": stages,
             "stage_layers": list(resolve_stage_layers(config.stage_layers, num_layers, stages,
                                                       chunks)),
             "remat_ratios": [str(r) for r in ratios], "virtual_stages": chunks,
             "backward_ticks": config.backward_ticks or None,
             "fused_ticks": config.fused_ticks, "split_head": config.split_head,
             "predicted_pipeline_s": predicted_pipeline_s,
             "predicted_stage_memory_bytes": None if predicted_stage_memory_bytes is None
             else list(predicted_stage_memory_bytes), "exact": exact}
    return {k: v for k, v in entry.items() if v is not None}


def pipeline_config(entry: PipelineEntry) -> PipelineConfig:
    """A plan's stage section as the pipeline config it describes: the stages' layers and
    ratios as recorded, the tick table it was priced on (absent: the runtime's rule); the
    predictions stay in the plan."""
    return PipelineConfig(schedule=entry.schedule, stage_layers=tuple(entry.stage_layers),
                          virtual_stages=entry.virtual_stages,
                          remat_ratios=tuple(entry.remat_ratios),
                          backward_ticks=entry.backward_ticks or 0,
                          fused_ticks=entry.fused_ticks, split_head=bool(entry.split_head))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A loaded plan: what `scripts/train.py` and `scripts/inspect_hlo.py` need from it."""

    mesh: str  # "data=2,tensor=4"
    rules: str
    microbatches: int
    global_batch: int
    seq_len: int
    layers: tuple[LayerSpec, ...]
    raw: dict
    config: ModelConfig | None = None  # the model it names (model_config, else its preset)
    pipeline: PipelineConfig | None = None  # its stage section (`pipeline_config`); None: none

    @property
    def schedule(self) -> str:
        """The run's schedule (`ParallelConfig.schedule`): primepar for a primepar plan, whose
        weights are stored in primepar's block layout; megatron otherwise (each layer then
        runs its own entry's schedule)."""
        return "primepar" if self.layers[0].schedule == "primepar" else "megatron"

    def parallel(self) -> ParallelConfig:
        """The parallel config a run of this plan trains and compiles with."""
        from oases_jax.training.config import ParallelConfig

        moe = self.raw.get("moe")
        if moe:  # one dense strategy on every layer (the model carries its remat: run_model)
            return ParallelConfig(
                mesh=self.mesh, rules=self.rules, schedule=self.layers[0].schedule,
                sub_batches=self.layers[0].sub_batches, moe_schedule=moe["schedule"],
                moe_chunks=moe.get("chunks", 1) if moe["schedule"] == "parm_s2" else 0)
        pipe = self.pipeline
        if pipe and pipelines.get(pipe.schedule).equal_stages:  # the model's remat
            return ParallelConfig(mesh=self.mesh, rules=self.rules,
                                  schedule=self.layers[0].schedule,
                                  sub_batches=self.layers[0].sub_batches,
                                  pipeline=PipelineConfig(schedule=pipe.schedule))
        if pipe:  # the stages carry the remat; per-layer strategies where the layers differ
            mixed = len(set(self.layers)) > 1
            return ParallelConfig(
                mesh=self.mesh, rules=self.rules, schedule=self.layers[0].schedule,
                sub_batches=self.layers[0].sub_batches, pipeline=pipe,
                layers=tuple(self.layers) if mixed else None)
        return ParallelConfig(mesh=self.mesh, rules=self.rules, schedule=self.schedule,
                              layers=tuple(self.layers))

    def run_model(self, model: ModelConfig) -> ModelConfig:
        """The model a run of this plan trains: `model` itself, or for an MoE plan `model`
        with the plan's remat policy (the runtime's MoE layer groups take the model's remat,
        `oases_jax.moe.stack.run_groups`, not a per-layer one)."""
        if self.raw.get("moe"):
            return model.replace(remat=self.layers[0].remat)
        pipe = self.pipeline
        if pipe and pipelines.get(pipe.schedule).equal_stages:  # every stage or none
            full = any(r > 0 for r in pipe.remat_ratios or ())
            return model.replace(remat="full" if full else "none")
        return model

    def compile_spec(self, model: ModelConfig) -> CompileSpec:
        """The whole train step this plan describes, every layer under its own strategy."""
        from oases_jax.training.program import CompileSpec

        return CompileSpec(model=self.run_model(model), parallel=self.parallel(),
                           batch_size=self.global_batch, seq_len=self.seq_len,
                           microbatches=self.microbatches)

    def model(self, where: str = "plan") -> ModelConfig:
        """The model the plan was made for: its `model_config`, else its `model` preset."""
        if self.config is None:
            raise UserError(f"{where} names no model (no `model` or `model_config`); pass --model")
        return self.config

    def check_model(self, cfg: ModelConfig) -> None:
        if len(self.layers) != cfg.n_layers:
            raise UserError(
                f"the plan has {len(self.layers)} layer entries but the model has "
                f"{cfg.n_layers} layers; plan again for this model with scripts/plan.py"
            )


def save(plan: dict, path: str | pathlib.Path) -> None:
    write_atomic(pathlib.Path(path), json.dumps(plan, indent=1) + "\n")


def load(path: str | pathlib.Path) -> Plan:
    """Read and validate a plan file; every problem is a one-line UserError."""
    d = read_json(path, "plan file", "make one with scripts/plan.py --json PLAN.json, or use "
                  "--plan auto")
    return from_json(d, f"plan file {str(path)!r}")


def from_json(d: object, where: str = "plan") -> Plan:
    """A plan from its parsed JSON, validated (`planner.plan_schema`): one UserError line naming
    the field, the value and the fix for whatever is wrong."""
    p = validate(PlanFile, d, where=where, kind="plan", fix=FIX)
    config = check(p, where)
    layers = tuple(LayerSpec(schedule=s.schedule, sub_batches=s.sub_batches, remat=s.remat)
                   for s in p.layers)
    try:
        pipeline = None if p.pipeline is None else pipeline_config(p.pipeline)
    except UserError as e:
        raise UserError(f"{where}: pipeline: {e}; {FIX}") from None
    return Plan(mesh=",".join(f"{k}={v}" for k, v in p.mesh.items()), rules=p.rules,
                microbatches=p.microbatches, global_batch=p.global_batch, seq_len=p.seq_len,
                layers=layers, raw=d, config=config, pipeline=pipeline)


def report_3d(cands: list[PipelineCandidate], megatron: list[PipelineCandidate],
              best_2d_s: float, search_s: float, top: int) -> str:
    """`plan.py --pipeline`'s lines: the ranked 3D plans, Megatron-LM's plan, the best 2D plan."""
    width = max([len("plan"), *(len(c.summary()) for c in cands[:top])])  # whole, never cut
    lines = [f"3D plans (data x stage x tensor), searched in {search_s:.2f} s:",
             f"{'#':>3}  {'plan':<{width}} {'step ms':>10} {'peak GiB':>9}"]
    for i, c in enumerate(cands[:top]):
        lines.append(f"{i + 1:3d}  {c.summary():<{width}} {c.step_s * 1e3:10.2f} "
                     f"{c.peak_memory_bytes / 2**30:9.2f}")
    if megatron:
        m = megatron[0]
        lines.append(f"Megatron-LM's 3D plan (uniform stages, 1F1B, full recompute): "
                     f"{m.summary()}  {m.step_s * 1e3:.2f} ms")
    if cands:
        lines.append(f"best 3D plan {cands[0].step_s * 1e3:.2f} ms against the best 2D plan "
                     f"{best_2d_s * 1e3:.2f} ms: "
                     + ("the 3D plan is chosen" if cands[0].step_s < best_2d_s
                        else "the 2D plan stays"))
    else:
        lines.append("no 3D plan fits")
    return "\n".join(lines)
