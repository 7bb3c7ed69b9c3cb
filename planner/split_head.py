"""The head split over the pipeline's stages by positions (`--split-head on`,
`training.pipeline_head`), as the 3D search prices it: a phase every stage runs once a
micro-batch in place of the last stage's head (docs/parallelism.md, "Split head")."""

from __future__ import annotations

import dataclasses

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.layer_work import stream_bytes
from oases_jax.planner.layout import Layout
from oases_jax.planner.prices import Hardware
from oases_jax.planner.stage_types import StageInputs
from oases_jax.planner.step_cost import head_cost

__all__ = ["SPLIT_HEAD_MARGIN", "split_head_inputs"]

# The screen's error between the two heads (its bubble estimate knows no fused ticks: fused 1F1B
# and interleaved ran 3.0-3.9% faster compiled, docs/parallelism.md "Fused ticks"); beyond it the
# slower-screened head is not partitioned.
SPLIT_HEAD_MARGIN = 0.05


def split_head_inputs(cfg: ModelConfig, layout: Layout, hw: Hardware, strategy: LayerSpec,
                      x: StageInputs, stages: int) -> StageInputs | None:
    """`x` with the head split over the stages by positions (`--split-head on`,
    `training.pipeline_head`): no head on the last stage; every device runs, once a
    micro-batch, the head and loss of 1/S of its positions (`head_cost` / S) after a
    reduce-scatter over `stage` of the last stage's output and before the all-gather of its
    gradient, and keeps 1/S of the logits. None where the runtime cannot split it (the
    sequence not into S equal slices)."""
    if stages < 2 or layout.seq_len % stages:
        return None
    head_s, head_temp = head_cost(cfg, layout, hw)
    nbytes = stream_bytes(cfg, layout, strategy.schedule)
    group = layout.stage_group(stages)
    phase = head_s / stages + hw.comm_s("reduce-scatter", nbytes, group) \
        + hw.comm_s("all-gather", nbytes, group)
    return dataclasses.replace(x, last_f=0.0, last_b=0.0, last_temp=head_temp / stages,
                               head_phase=phase)
