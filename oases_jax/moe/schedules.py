"""The MoE schedule registry: one record per way of running an MoE feed-forward over the
`expert` (EP) and `tensor` (MP attention, ESP experts) mesh axes, in the style of
`oases_jax.registry` (docs/parallelism.md, "Mixture of experts")."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from oases_jax.errors import UserError

_LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEScheduleSpec:
    """One MoE schedule. `dedup`: tokens are split over the MP ranks before gating (each token
    gated and dispatched once); `chunked`: the dispatch all-to-all and the ESP all-gather (and
    on the way back the reduce-scatter and the all-to-all) run per capacity chunk, so chunk i's
    intra-node collective can run while chunk i+1's inter-node one is in flight."""

    name: str
    summary: str
    dedup: bool = True
    chunked: bool = False
    needs_expert_axis: bool = True
    gpu_options: Mapping = dataclasses.field(default_factory=lambda: MappingProxyType(_LHS))

    def __post_init__(self):
        object.__setattr__(self, "gpu_options", MappingProxyType(dict(self.gpu_options)))


MOE_SCHEDULES: Mapping[str, MoEScheduleSpec] = MappingProxyType({s.name: s for s in (
    MoEScheduleSpec(name="ds_moe", summary="DeepSpeed-MoE: every MP rank gates all (duplicated) "
                    "tokens, keeps 1/N_MP of the capacity slots, all-to-all, ESP all-gather, "
                    "expert GEMMs, ESP reduce-scatter, all-to-all back, MP all-reduce",
                    dedup=False),
    MoEScheduleSpec(name="parm_s1", summary="Parm S1: tokens de-duplicated over the MP ranks "
                    "before gating (split after the all-reduce, or reduce-scattered under "
                    "megatron_sp); MP resumes after the combine"),
    # Two collectives in flight (a chunk's all-to-all and the previous chunk's all-gather); no
    # dot merger: it would fuse the chunks' expert GEMMs back into one; and no all-gather or
    # reduce-scatter combiner: with it XLA merged the chunks' ESP all-gathers into one that
    # waited for every chunk's all-to-all, and nothing overlapped (small-moe on h100:8;
    # docs/parallelism.md, "S2 in the compiled GPU program").
    MoEScheduleSpec(name="parm_s2", summary="Parm S2: S1 with the all-to-all and the ESP "
                    "all-gather (and the reduce-scatter and the all-to-all back) pipelined over "
                    "capacity chunks", chunked=True, gpu_options={
                        **_LHS, "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
                        "xla_gpu_all_gather_combine_threshold_bytes": 0,
                        "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
                        "xla_disable_hlo_passes": "dot-merger"}),
    MoEScheduleSpec(name="local", summary="no expert axis: every device holds all experts, "
                    "tokens de-duplicated over MP and the experts' FFNs split over it (S1 with "
                    "N_EP = 1); what `auto` runs on a mesh without an expert axis",
                    needs_expert_axis=False),
)})

# `auto` picks parm_s1 or parm_s2 (and S2's chunk count) by the alpha-beta model
# (`oases_jax.moe.cost`), or `local` on a mesh without an expert axis.
CHOICES = ("auto", *MOE_SCHEDULES)


def get(name: str) -> MoEScheduleSpec:
    try:
        return MOE_SCHEDULES[name]
    except KeyError:
        raise UserError(f"unknown --moe-schedule {name!r}; choose one of "
                        f"{', '.join(CHOICES)}") from None


def check(name: str) -> None:
    """`name` is `auto` or a registered schedule."""
    if name != "auto":
        get(name)
