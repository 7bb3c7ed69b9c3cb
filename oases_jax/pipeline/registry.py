"""The pipeline schedule registry: one record per pipeline schedule, as `oases_jax.registry` is
for the tensor-parallel ones.

A record holds the schedule's builder (one signature: `build(stages, microbatches, *,
chunks=1, recompute=...) -> Schedule`), the executor that runs it, and what it can do: the
micro-batch counts it needs, whether it holds several model chunks per stage, whether its
stages must be equal, whether collective-permutes (rings, PrimePar's square) may run inside
its stages, which per-stage settings apply. Every list, CLI help, plan-schema literal,
compatibility check and planner option derives from `PIPELINES`; adding a schedule means
adding its record, its builder and its tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

from oases_jax import registry as tp_registry
from oases_jax.errors import UserError
from oases_jax.pipeline import schedules
from oases_jax.pipeline.table import Schedule

# The executors (docs/parallelism.md, "Pipeline schedules"):
#   ticks       `oases_jax.pipeline.executor`: lockstep ticks, each a switch over the stages'
#               actions read from the schedule's table (uneven stages, per-stage recompute)
#   spmd_gpipe  `training.pipeline_spmd.spmd_pipeline_grads`: GPipe as one scan, the same
#               program on every device every tick (no switch), autodiff for the backward
#   spmd_1f1b   `training.pipeline_spmd.spmd_1f1b_grads`: 1F1B in lockstep with no switch,
#               each backward recomputing its stage
EXECUTORS = ("ticks", "spmd_gpipe", "spmd_1f1b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineScheduleSpec:
    """One pipeline schedule and what it can run."""

    name: str
    summary: str
    build: Callable[..., Schedule]
    # The executor that runs it (`EXECUTORS`); None: a table with no executor yet, refused with
    # `refusal` (what it would need) wherever a run or a plan asks for it.
    executor: str | None
    refusal: str = ""
    needs_m_ge_s: bool = False  # at least as many micro-batches as stages
    m_multiple_of_s: bool = False  # micro-batches in groups of S
    chunks: int = 1  # model chunks per stage by default; > 1: `--virtual-stages` applies
    # One program on every device: equal stages under the model's --remat, and none of the
    # tick executor's per-stage settings (--stage-layers, --remat-ratios, --backward-ticks,
    # --fused-ticks, --split-head) or per-layer plans.
    equal_stages: bool = False
    ticked: str = ""  # equal stages: the schedule of the same table under the tick executor
    # Collective-permutes may run inside its stages: the ring schedules and PrimePar's square.
    # Inside the tick's per-stage switch, where devices of different stages take different
    # branches, all-reduces, all-gathers and reduce-scatters over `tensor` meet in the tensor
    # group, but a collective-permute's rendezvous is every device (the CPU runtime; permutes
    # run by no other stage never complete). megatron_sp runs there: its token shift and
    # position rows are taken outside the loop (`training.pipeline_layout.shifted`).
    permutes_inside: bool = False
    shifted_recompute: bool = False  # Merak's stage-aware recompute shifted by a stage
    # The recompute its builder takes: "flags" (none, all or per stage), "every" (each B
    # recomputes its stage: the executor keeps only the stage's inputs), "own" (its own
    # placement: Merak's shifted critical path).
    recompute: str = "flags"

    def __post_init__(self):
        if self.executor is not None and self.executor not in EXECUTORS:
            raise ValueError(f"{self.name}: executor {self.executor!r} not in {EXECUTORS}")
        if self.equal_stages != bool(self.ticked):
            raise ValueError(f"{self.name}: equal stages name their tick-executor schedule")
        if (self.executor is None) != bool(self.refusal):
            raise ValueError(f"{self.name}: a refusal exactly when there is no executor")

    @property
    def runnable(self) -> bool:
        return self.executor is not None

    @property
    def per_stage_settings(self) -> bool:
        """Stages may differ (uneven layers, per-stage recompute, split head, fused ticks)."""
        return not self.equal_stages

    def runs(self, schedule: str) -> bool:
        """Whether a tensor-parallel schedule runs inside this pipeline's stages."""
        return self.permutes_inside or not tp_registry.get(schedule).permutes

    def check_runnable(self) -> None:
        if not self.runnable:
            raise UserError(f"--pipeline {self.name} {self.refusal}; use one of "
                            f"{', '.join(names(runnable=True))}")

    def check_chunks(self, chunks: int) -> int:
        """The chunks per stage a run asks for (0: the default) checked against the schedule."""
        if chunks == 0:
            return self.chunks
        if self.chunks == 1 and chunks != 1:
            raise UserError(f"--virtual-stages {chunks} needs a schedule with model chunks per "
                            f"stage ({', '.join(names(chunked=True))}); the {self.name} "
                            f"schedule holds one chunk per stage")
        if self.chunks > 1 and chunks < 2:
            raise UserError(f"--virtual-stages {chunks}: {self.name} needs >= 2 chunks per "
                            f"stage (v=1 is the 1f1b schedule)")
        return chunks

    @property
    def chunked(self) -> bool:
        return self.chunks > 1

    def table(self, stages: int, microbatches: int, *, chunks: int = 0,
              recompute=None) -> Schedule:
        """The schedule's table, its micro-batch and chunk checks included."""
        kw = {} if recompute is None else {"recompute": recompute}
        return self.build(stages, microbatches, chunks=self.check_chunks(chunks), **kw)


_Spec = PipelineScheduleSpec
PIPELINES: Mapping[str, PipelineScheduleSpec] = MappingProxyType({p.name: p for p in (
    _Spec(name="gpipe", summary="GPipe: every forward, then every backward",
          build=schedules.gpipe, executor="ticks"),
    _Spec(name="gpipe_spmd", summary="GPipe with no per-stage control flow: rings and "
          "PrimePar's square inside the stages", build=schedules.gpipe_spmd,
          executor="spmd_gpipe", equal_stages=True, ticked="gpipe", permutes_inside=True),
    _Spec(name="1f1b", summary="1F1B: one forward and one backward in turn, at most S-s "
          "micro-batches in flight", build=schedules.one_f_one_b, executor="ticks"),
    _Spec(name="1f1b_spmd", summary="1F1B with no per-stage control flow, each backward "
          "recomputing its stage", build=schedules.one_f_one_b_spmd, executor="spmd_1f1b",
          equal_stages=True, ticked="1f1b", permutes_inside=True, recompute="every"),
    _Spec(name="interleaved", summary="Megatron's interleaved 1F1B: v model chunks per stage",
          build=schedules.interleaved, executor="ticks", needs_m_ge_s=True,
          m_multiple_of_s=True, chunks=2),
    _Spec(name="merak", summary="Merak's shifted critical path: 1F1B with recompute hoisted "
          "into the bubbles", build=schedules.merak, executor="ticks", needs_m_ge_s=True,
          shifted_recompute=True, recompute="own"),
    _Spec(name="zb_h1", summary="ZB-H1: 1F1B with the weight gradients deferred into the "
          "cool-down", build=schedules.zb_h1, executor=None, needs_m_ge_s=True,
          refusal="splits each backward into B (input gradient) and W (weight gradient), "
          "which no executor runs yet"),
)})


def names(*, runnable: bool | None = None, chunked: bool | None = None,
          equal_stages: bool | None = None, permutes_inside: bool | None = None,
          executor: str | None = None) -> tuple[str, ...]:
    """Schedule names in registry order, filtered by capability (None: either)."""
    want = {"runnable": runnable, "chunked": chunked, "equal_stages": equal_stages,
            "permutes_inside": permutes_inside, "executor": executor}
    return tuple(n for n, p in PIPELINES.items()
                 if all(v is None or getattr(p, k) == v for k, v in want.items()))


def get(name: str) -> PipelineScheduleSpec:
    """The record of a pipeline schedule; an unknown name is a UserError listing them all."""
    try:
        return PIPELINES[name]
    except KeyError:
        refused = [n for n in PIPELINES if not PIPELINES[n].runnable]
        raise UserError(f"unknown --pipeline {name!r}: choose one of {', '.join(PIPELINES)} "
                        f"({', '.join(refused)}: no executor yet)") from None


def runnable(name: str) -> PipelineScheduleSpec:
    """The record of a schedule that runs; one that has no executor is refused with why."""
    spec = get(name)
    spec.check_runnable()
    return spec


def stage_schedules() -> tuple[str, ...]:
    """The tensor-parallel schedules every pipeline runs inside its stages (no permutes)."""
    return tp_registry.names(permutes=False)
