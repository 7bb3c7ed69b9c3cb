"""The schedule registry: one record per tensor-parallel / partition schedule.

Everything that used to be restated per schedule (the rule set it runs under, whether it is
sequence parallel, uses rings or sub-batches, its weight layout, the XLA options it needs on a
GPU, the projection strategy that implements it) is a field here. Lists, CLI choices, the planner's
options and the compile path derive from `SCHEDULES`; adding a schedule means adding a record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from oases_jax.errors import UserError

# Projection strategies (`oases_jax.projections.strategy_for` builds them):
#   gspmd     plain einsums; the partitioner inserts Megatron's collectives
#   gspmd_pinned  plain einsums with their model dimension pinned (XLA's windowed einsum)
#   seq_parallel  Megatron-SP: all-gather before the column projections, reduce-scatter after
#             the row projections, one shard_map per projection
#   ring      ppermute rings overlapping each chunk's GEMM (shard_map per projection)
#   manual    local projections inside a layer-wide shard_map, explicit all-reduces (Oases)
#   primepar  Cannon-style projections on a tp_row x tp_col square
PROJECTIONS = ("gspmd", "gspmd_pinned", "seq_parallel", "ring", "manual", "primepar")
# How a segment of layers is run (`oases_jax.stacks`): a scan of layers whose projections
# carry their own communication, one shard_map per layer ordering sub-batches, or one
# shard_map over the whole segment with the Oases cross-layer overlap.
RUNNERS = ("scan", "manual_layer", "overlapped_stack")

_LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """One schedule. `rules` is the rule set a run asking for plain `tp` gets (the sequence-parallel
    schedules shard the residual stream on `seq` between blocks, primepar has its own set)."""

    name: str
    summary: str
    rules: str = "tp"
    sequence_parallel: bool = False
    rings: bool = False  # projections move blocks around ppermute rings
    # Its program holds collective-permutes (rings, the square's rotations, XLA's windowed
    # einsum): inside a pipeline's per-stage switch they would wait for every device
    # (`oases_jax.pipeline.registry.PipelineScheduleSpec.permutes_inside`).
    permutes: bool = False
    sub_batches: bool = False  # a micro-batch splits into sub-batches (Oases step order)
    overlapped_stack: bool = False  # a layer's last collective hides in the next layer
    projection: str = "gspmd"
    manual_projection: str | None = None  # inside a layer-wide shard_map (sub-batch schedules)
    weight_layout: str = "standard"  # "primepar": projection weights stored block-permuted
    mesh_axes: tuple[str, ...] = ("tensor",)  # the mesh axes it splits projections over
    gpu_options: Mapping = dataclasses.field(default_factory=lambda: MappingProxyType(_LHS))
    may_abort: bool = False  # XLA may abort the compile: tools compile it in a child process
    planned: bool = True  # the planner chooses between it and the others

    def __post_init__(self):
        if self.projection not in PROJECTIONS:
            raise ValueError(f"{self.name}: projection {self.projection!r} not in {PROJECTIONS}")
        object.__setattr__(self, "gpu_options", MappingProxyType(dict(self.gpu_options)))

    @property
    def square(self) -> bool:
        return self.mesh_axes == ("tp_row", "tp_col")

    def runner(self, sub_batches: int, tensor_size: int) -> str:
        """How a segment of this schedule runs, given its sub-batch count and the size of its
        tensor axis (nothing is manual without a tensor split to overlap)."""
        if not self.sub_batches or tensor_size <= 1:
            return "scan"
        if self.overlapped_stack and sub_batches > 1:
            return "overlapped_stack"
        return "manual_layer"

    def rules_for(self, base: str) -> str:
        """The rule set a layer of this schedule runs under, given the run's rule set: `tp`
        becomes `tp_sp` for sequence-parallel schedules and back; other sets are kept."""
        if self.rules == "primepar":
            return "primepar"
        if self.sequence_parallel and base == "tp":
            return "tp_sp"
        if not self.sequence_parallel and base == "tp_sp":
            return "tp"
        return base

    def layer_sub_batches(self, sub_batches: int) -> int:
        return sub_batches if self.sub_batches else 1


def _opts(**kw) -> dict:
    return {**_LHS, **kw}


_NO_DOT_MERGER = {"xla_disable_hlo_passes": "dot-merger"}

SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType({s.name: s for s in (
    ScheduleSpec(name="megatron", summary="Megatron tensor parallelism: GSPMD all-reduces after "
                 "the row projections"),
    ScheduleSpec(name="megatron_sp", summary="Megatron + sequence parallelism: all-gather before "
                 "the column projections, reduce-scatter after the row projections",
                 sequence_parallel=True, projection="seq_parallel"),
    # Two permutes in flight at once: a backward ring step moves a block and a partial sum. The
    # dot merger would fuse GEMMs that share an operand (a ring step's two chunks) into one,
    # which then waits for both inputs' collectives.
    ScheduleSpec(name="collective_matmul", summary="every projection a ppermute ring that "
                 "overlaps its chunk GEMMs, forward and backward", sequence_parallel=True,
                 rings=True, permutes=True, projection="ring", gpu_options=_opts(
                     xla_gpu_experimental_parallel_collective_overlap_limit=2, **_NO_DOT_MERGER)),
    # Keep each sub-batch's collective separate: XLA's combiners would merge them into one.
    ScheduleSpec(name="oases", summary="sub-batches whose all-reduces hide behind each other's "
                 "compute, within a layer and across layer boundaries", sub_batches=True,
                 overlapped_stack=True, manual_projection="manual", gpu_options=_opts(
                     xla_gpu_all_reduce_combine_threshold_bytes=0,
                     xla_gpu_all_gather_combine_threshold_bytes=0,
                     xla_gpu_reduce_scatter_combine_threshold_bytes=0, **_NO_DOT_MERGER)),
    # Oases' order on Megatron-SP's layout: the norms and residual adds on 1/t of the sequence,
    # each sub-batch's all-gather and reduce-scatter beside another's compute.
    ScheduleSpec(name="oases_sp", summary="sub-batches on the sequence-parallel layout: each "
                 "sub-batch's all-gather and reduce-scatter hide behind another's compute",
                 sequence_parallel=True, sub_batches=True, overlapped_stack=True,
                 projection="seq_parallel", manual_projection="seq_manual",
                 # Priced (`planner.cost.layer_cost`, "seq_deferred"), not yet searched: its
                 # plans broke the benchmark set's contract (docs/planner.md, "Search").
                 planned=False,
                 gpu_options=_opts(
                     xla_gpu_all_gather_combine_threshold_bytes=0,
                     xla_gpu_reduce_scatter_combine_threshold_bytes=0, **_NO_DOT_MERGER)),
    # Three in flight: a bidirectional backward ring step moves four halves (two of the block,
    # two of the partial sum); with 2, two of them had no GEMM on `small` (share 0.80).
    ScheduleSpec(name="oases_cm", summary="Oases sub-batches whose projections are rings",
                 sequence_parallel=True, rings=True, permutes=True, sub_batches=True,
                 projection="ring",
                 manual_projection="ring", gpu_options=_opts(
                     xla_gpu_experimental_parallel_collective_overlap_limit=3,
                     xla_gpu_collective_permute_combine_threshold_bytes=0, **_NO_DOT_MERGER)),
    # The pinned projections keep XLA's windowed-einsum pass from the case it aborts on
    # (docs/xla_estimate.md); thresholds of 0 and 1 MiB give the same programs on GPT-2 1.5B,
    # and 1 MiB leaves the small model's tiny einsums alone. A child process still guards the
    # compile of shapes nobody has tried.
    ScheduleSpec(name="xla_auto", summary="XLA's own windowed einsum (collective matmul) over "
                 "sequence-parallel einsums", sequence_parallel=True, projection="gspmd_pinned",
                 permutes=True, may_abort=True, planned=False,
                 gpu_options=_opts(xla_gpu_threshold_for_windowed_einsum_mib=1,
                                   xla_gpu_multi_streamed_windowed_einsum=True)),
    # A primepar backward step has three permutes in flight (two blocks and a partial sum);
    # the combiner would merge a step's weight shifts into one synchronous permute.
    ScheduleSpec(name="primepar", summary="spatial-temporal partitioning on a tp_row x tp_col "
                 "square: Cannon-style rings, no all-reduce, nothing replicated",
                 rules="primepar", permutes=True, projection="primepar",
                 weight_layout="primepar",
                 mesh_axes=("tp_row", "tp_col"), gpu_options=_opts(
                     xla_gpu_experimental_parallel_collective_overlap_limit=3,
                     xla_gpu_collective_permute_combine_threshold_bytes=0)),
)})


def get(name: str) -> ScheduleSpec:
    """The record of schedule `name`; an unknown name is a UserError listing the choices."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise UserError(f"unknown --schedule {name!r}; choose one of "
                        f"{', '.join(SCHEDULES)}") from None


def names(**where) -> tuple[str, ...]:
    """Schedule names in registry order, filtered by field values (`names(rings=True)`)."""
    return tuple(n for n, s in SCHEDULES.items()
                 if all(getattr(s, k) == v for k, v in where.items()))


def compiler_options(schedules: str | Iterable[str], platform: str) -> dict:
    """XLA options for the schedules one program runs (a plan mixes them per layer), on
    `platform` ("gpu" for real and deviceless GPUs alike; other platforms get none): the union of
    each schedule's `gpu_options`, where they differ the value that serves them all (the most
    collectives in flight, the lowest combine or windowed-einsum threshold). Options are
    per-program, so a megatron layer beside an oases one also loses the combiners; disabled
    passes are the union of the lists."""
    if platform not in ("gpu", "cuda", "rocm"):
        return {}
    out: dict = {}
    for name in [schedules] if isinstance(schedules, str) else schedules:
        out = merge_options(out, get(name).gpu_options)
    return out


def merge_options(out: Mapping, options: Mapping) -> dict:
    """Two programs' XLA options as one (the rules of `compiler_options`)."""
    out = dict(out)
    for key, value in options.items():
        if key not in out:
            out[key] = value
        elif key == "xla_disable_hlo_passes":  # comma-separated pass names: their union
            have = out[key].split(",")
            out[key] = ",".join(have + [n for n in value.split(",") if n not in have])
        elif key.endswith("_limit") or isinstance(value, bool):
            out[key] = max(out[key], value)
        else:
            out[key] = min(out[key], value)
    return out
