"""The planner's opinion of plans that were measured: price a benchmark's variants with the cost
model and compare the two rankings (`scripts/bench.py --predict`).

A variant `MESH/RULES/SCHEDULE` is the planner's layout (`replicas x tensor`, parameters
replicated under `dp`/`tp`/`tp_sp` or sharded under `fsdp`/`fsdp_tp`) with one strategy on every
layer. Variants the cost model does not describe (the compiler's own `xla_auto`, meshes with
other axes) get no prediction and stay out of the correlation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from oases_jax import registry
from oases_jax.layer_plan import LayerSpec
from oases_jax.mesh import parse_mesh
from oases_jax.models.config import ModelConfig
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import step_cost
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.dense import SCHEDULES

FSDP_RULES = ("fsdp", "fsdp_tp")


def layout_of(mesh: str, rules: str, *, global_batch: int, seq_len: int) -> Layout | None:
    """The planner layout of a resolved mesh string under `rules`; None if it has axes the
    cost model does not price (anything but data and tensor)."""
    spec = parse_mesh(mesh)
    if set(spec.names) - {"data", "tensor"}:
        return None
    replicas, tensor = spec.size("data"), spec.size("tensor")
    if rules in FSDP_RULES and replicas > 1:
        return Layout(fsdp=replicas, tensor=tensor, global_batch=global_batch, seq_len=seq_len)
    return Layout(data=replicas, tensor=tensor, global_batch=global_batch, seq_len=seq_len)


def predict_step_s(cfg: ModelConfig, hw: Hardware, *, mesh: str, rules: str, schedule: str,
                   sub_batches: int, global_batch: int, seq_len: int,
                   microbatches: int = 1) -> float | None:
    """Predicted seconds of one optimizer step of the variant (its global batch accumulated
    over `microbatches`), or None if not modelled."""
    if schedule not in SCHEDULES:
        return None
    layout = layout_of(mesh, rules, global_batch=global_batch, seq_len=seq_len)
    if layout is None:
        return None
    layout = dataclasses.replace(layout, microbatches=microbatches)
    k = registry.get(schedule).layer_sub_batches(sub_batches)
    strategy = LayerSpec(schedule=schedule if layout.tensor > 1 else "megatron",
                         sub_batches=k if layout.tensor > 1 else 1, remat=cfg.remat)
    return step_cost(cfg, layout, [strategy] * cfg.n_layers, hw).step_s


def predict_pipeline_step_s(cfg: ModelConfig, hw: Hardware, *, mesh: str, rules: str,
                            schedule: str, pipeline: PipelineConfig, microbatches: int,
                            global_batch: int, seq_len: int) -> float | None:
    """Predicted seconds of one step of a pipelined variant, priced as the 3D search prices its
    plans (`planner.search.pipeline`): its stages as `pipeline` gives them (uniform by default),
    every layer recomputed under `remat=full`, under `none` the first floor(n_i r_i) layers of
    stage i by the stage-aware ratios (none without them); under Merak's schedule every stage
    but the last is recomputed whole whatever is asked, as the program runs it. None if not
    modelled (another remat policy, axes beyond stage x data x tensor, a schedule the stages do
    not run)."""
    from oases_jax.pipeline import registry as pipelines
    from oases_jax.planner.search.pipeline import price, stage_inputs, transfer_s
    from oases_jax.planner.search.spmd_stages import spmd_fixed, spmd_head_s, spmd_weight_pass_s
    from oases_jax.planner.search.stage_partition import fixed
    from oases_jax.training.pipeline_layout import PipelineSpec

    spec = parse_mesh(mesh)
    inside = ",".join(f"{n}={s}" for n, s in spec.axes if n != "stage") or "data=1"
    layout = layout_of(inside, rules, global_batch=global_batch, seq_len=seq_len)
    if layout is None or cfg.remat not in ("full", "none") or schedule not in SCHEDULES:
        return None
    layout = dataclasses.replace(layout, microbatches=microbatches)
    stages, tensor = spec.size("stage"), layout.tensor
    pipe = PipelineSpec.of(pipeline, stages=stages, microbatches=microbatches,
                           num_layers=cfg.n_layers)
    pipe_spec = pipelines.get(pipeline.schedule)
    counts, chunks = pipe.layers, pipe.chunks
    strategy = LayerSpec(schedule=schedule if tensor > 1 else "megatron")
    x = stage_inputs(cfg, layout, hw, strategy, pools=pipe_spec.recompute != "every")
    p2p = transfer_s(cfg, layout, hw, strategy, stages)
    if cfg.remat == "full":
        remat = list(counts)
    else:  # the layers the runtime recomputes, summed over a device's chunks
        k = pipe.recomputed()
        remat = [sum(k[c * stages + s] for c in range(chunks)) for s in range(stages)]
    if pipe_spec.equal_stages:
        sp = spmd_fixed(x, counts, remat, microbatches, p2p, float("inf"),
                        spmd_head_s(cfg, layout, hw, strategy, stages, pipeline.schedule),
                        pipeline.schedule, spmd_weight_pass_s(cfg, layout, hw, stages))
    else:
        sp = fixed(x, schedule=pipeline.schedule, counts=counts, remat=remat,
                   microbatches=microbatches, chunks=chunks, p2p=p2p)
    return price(cfg, hw, stages, layout, strategy, sp, x, p2p).step_s if sp else None


def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties sharing the mean of their ranks."""
    v = np.asarray(values, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(1, len(v) + 1)
    for x in np.unique(v):
        tie = v == x
        r[tie] = r[tie].mean()
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the tie-averaged ranks."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two sequences of the same length >= 2, got {len(a)}, {len(b)}")
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra @ ra) * (rb @ rb)))
    return float(ra @ rb / denom) if denom else float("nan")
