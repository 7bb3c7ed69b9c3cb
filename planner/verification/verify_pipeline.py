"""Verifying 3D plans: compile the 3D search's top plans for a GPU target through the one compile
path (`tools.inspection`, the program `train.py --plan` runs), time each compiled pipelined step
tick by tick (`analysis.pipeline_time`), and set the planner's prediction beside it; the ranking
agreement is Spearman's rho (docs/planner.md, "Verifying 3D plans")."""

from __future__ import annotations

import dataclasses

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.pipeline import registry as pipelines
from oases_jax.planner import plan as plans
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.pipeline import (
    PipelineCandidate,
    price,
    stage_inputs,
    transfer_s,
)
from oases_jax.planner.search.stage_partition import partition
from oases_jax.planner.verification.rank import spearman


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifiedStage:
    """One compiled 3D candidate; the compiled figures are None when it failed (`error`)."""

    candidate: PipelineCandidate
    rank: int  # 1-based, by predicted step
    simulated_step_s: float | None = None  # outside the tick loop + its ticks
    xla_step_s: float | None = None
    peak_memory_bytes: int | None = None
    idle_fraction: tuple[float, ...] | None = None  # per stage, of the compiled loop
    event_idle_fraction: tuple[float, ...] | None = None  # the event model's, same costs
    compile_s: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Predicted over simulated step."""
        if not self.simulated_step_s:
            return None
        return self.candidate.step_s / self.simulated_step_s

    def to_json(self) -> dict:
        c = self.candidate
        return {"label": c.summary(), "rank": self.rank, "predicted_step_s": c.step_s,
                "predicted_peak_memory_bytes": c.peak_memory_bytes,
                "backward_ticks": c.stage_plan.backward_ticks,
                "fused_ticks": c.stage_plan.fused_ticks,
                "simulated_step_s": self.simulated_step_s, "xla_step_s": self.xla_step_s,
                "compiled_peak_memory_bytes": self.peak_memory_bytes,
                "idle_fraction": self.idle_fraction,
                "event_idle_fraction": self.event_idle_fraction,
                "predicted_over_simulated": self.ratio, "compile_s": self.compile_s,
                "error": self.error}


def candidate(cfg: ModelConfig, hw: Hardware, stages: int, layout: Layout,
              strategy: LayerSpec, schedule: str) -> PipelineCandidate | None:
    """One hand-picked 3D plan of the tick executor, priced as `search_3d` prices its own:
    the balanced partition under the memory budget (None when none fits)."""
    chunks = pipelines.get(schedule).chunks
    x = stage_inputs(cfg, layout, hw, strategy)
    p2p = transfer_s(cfg, layout, hw, strategy, stages)
    sp = partition(x, schedule=schedule, stages=stages, microbatches=layout.microbatches,
                   chunks=chunks, p2p=p2p, budget=hw.memory_budget())
    return None if sp is None else price(cfg, hw, stages, layout, strategy, sp, x, p2p)


def compile_candidate(cfg: ModelConfig, c: PipelineCandidate, target: str, *, model: str,
                      cluster: str):
    """Compile candidate `c` for `target` through the one compile path (its plan JSON, as
    `train.py --plan` and `inspect_hlo.py --plan` read it): the `tools.inspection.Inspection`,
    whose `pipeline` block times the tick loop."""
    from oases_jax.targets import get_target
    from oases_jax.tools.inspection import inspect_program

    plan = plans.from_json(plans.pipeline_plan_json(c, model=model, cfg=cfg, cluster=cluster,
                                                    cost_source="model", search_s=0.0))
    return inspect_program(plan.compile_spec(plan.model()), get_target(target))


def verify_3d(cfg: ModelConfig, candidates: list[PipelineCandidate], target: str, *,
              model: str, cluster: str, n: int = 6) -> list[VerifiedStage]:
    """Compile the first `n` candidates (ranked by predicted step) for `target` (e.g. h100:16)
    and time each compiled step. A compile that fails is reported, not raised."""
    out = []
    for rank, c in enumerate(candidates[:n], 1):
        try:
            ins = compile_candidate(cfg, c, target, model=model, cluster=cluster)
        except Exception as e:  # a compile or analysis failure is a finding, not a crash
            out.append(VerifiedStage(candidate=c, rank=rank, error=str(e)[:300]))
            continue
        if ins.pipeline is None and pipelines.get(c.stage_plan.schedule).executor != "ticks":
            # No tick switch: the whole-program simulation is the step.
            out.append(VerifiedStage(
                candidate=c, rank=rank, simulated_step_s=ins.sim.step_s,
                xla_step_s=ins.xla.step_s if ins.xla else None,
                peak_memory_bytes=ins.analysis.peak_memory_bytes, compile_s=ins.compile_s))
            continue
        pipe = ins.pipeline or {}
        if "step_s" not in pipe:
            out.append(VerifiedStage(candidate=c, rank=rank, compile_s=ins.compile_s,
                                     error=pipe.get("error", "no pipeline timing")))
            continue
        out.append(VerifiedStage(
            candidate=c, rank=rank, simulated_step_s=pipe["step_s"],
            xla_step_s=ins.xla.step_s if ins.xla else None,
            peak_memory_bytes=ins.analysis.peak_memory_bytes,
            idle_fraction=tuple(pipe["idle_fraction"]),
            event_idle_fraction=tuple(pipe["events"]["idle_fraction"]),
            compile_s=ins.compile_s))
    return out


def agreement(rows: list[VerifiedStage]) -> dict:
    """Spearman's rho of predicted against simulated steps over the compiled rows, and how many
    predictions lie within 15% of the simulated step."""
    ok = [r for r in rows if r.simulated_step_s]
    rho = spearman([r.candidate.step_s for r in ok], [r.simulated_step_s for r in ok]) \
        if len(ok) >= 2 else None
    within = int(sum(abs(r.ratio - 1) <= 0.15 for r in ok))
    return {"compiled": len(ok), "spearman": rho, "within_15pct": within}


def table(rows: list[VerifiedStage]) -> str:
    lines = ["| # | plan | k | predicted | simulated | pred/sim | XLA | peak GiB | idle, compiled"
             " / event |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.candidate
        if r.error:
            lines.append(f"| {r.rank} | {c.summary()} | | {c.step_s * 1e3:.1f} ms | "
                         f"{r.error[:80]} | | | | |")
            continue
        idle = ", ".join(f"{x:.1%}" for x in r.idle_fraction or ()) or "-"
        event = ", ".join(f"{x:.1%}" for x in r.event_idle_fraction or ()) or "-"
        xla = f"{r.xla_step_s * 1e3:.1f} ms" if r.xla_step_s else "-"
        k = f"{c.stage_plan.backward_ticks}{' fused' if c.stage_plan.fused_ticks else ''}"
        lines.append(f"| {r.rank} | {c.summary()} | {k} | "
                     f"{c.step_s * 1e3:.1f} ms | {r.simulated_step_s * 1e3:.1f} ms | "
                     f"{r.ratio:.2f} | {xla} | {r.peak_memory_bytes / 2**30:.1f} | "
                     f"{idle} / {event} |")
    return "\n".join(lines)
