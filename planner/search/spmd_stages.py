"""The SPMD pipelines' stages and step (`gpipe_spmd`, `1f1b_spmd`: no per-stage control flow,
`training.pipeline_spmd`), for the 3D search (`planner.search.pipeline`) and
`planner.verification.rank`: equal stages, the head as its own phase on every device, and 1F1B's
lockstep ticks in closed form."""

from __future__ import annotations

import dataclasses

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.pipeline import registry as pipelines
from oases_jax.planner.cost.layer_work import elem_bytes, stream_bytes
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import head_cost
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.stage_partition import StageInputs, StagePlan, fixed

SPMD = "gpipe_spmd"  # the default: GPipe's table in one scan


def _lockstep_1f1b(schedule: str) -> bool:
    """1F1B in lockstep with no per-stage control flow (`spmd_1f1b`): its own closed form."""
    return pipelines.get(schedule).executor == "spmd_1f1b"


def uniform_stages(x: StageInputs, stages: int, microbatches: int, p2p: float,
                    budget: float, head_s: float = 0.0, schedule: str = SPMD,
                    weight_pass_s: float = 0.0) -> StagePlan | None:
    """An SPMD pipeline's stages: one program on every device, so equal stages, every layer
    recomputed or none (the model's `--remat`): none if it fits, else full."""
    n = x.n_layers // stages
    for k in (0, n):
        sp = spmd_fixed(x, [n] * stages, [k] * stages, microbatches, p2p, budget, head_s,
                        schedule, weight_pass_s)
        if sp is not None:
            return sp
    return None


def spmd_fixed(x: StageInputs, counts, remat, microbatches: int, p2p: float, budget: float,
               head_s: float, schedule: str = SPMD, weight_pass_s: float = 0.0
               ) -> StagePlan | None:
    """`fixed` for the SPMD pipelines, whose head is not in the ticks (`spmd_head_s`, which
    adds to every stage's finish: they run in lockstep).

    gpipe_spmd: GPipe's table. 1f1b_spmd (`training.pipeline_spmd.spmd_1f1b_grads`): S-1
    ticks of forwards, M ticks each of a forward, the head and a backward that recomputes the
    stage's forward first, S-1 ticks of backwards, one permute each way per tick that moves
    something; with per-stage F, B' = F + B (+ the layers' own recompute) at its slowest, and
    W the weight passes of each tick with a backward (`spmd_weight_pass_s`):

        (S-1) (F + p2p) + M (F + B' + W + 2 p2p) + (S-1) (B' + W + p2p) + head

    Its memory holds one micro-batch's residuals (in the backward's `vjp`) per stage
    (`stage_sim.peak_inflight`); the 2S-1 stage inputs it keeps are left out."""
    # Every device computes every tick (the bubbles on placeholders), so no core is left idle
    # for another device to take: no `shared` pricing.
    sp = fixed(dataclasses.replace(x, last_f=0.0, last_b=0.0, shared=None), schedule=schedule,
               counts=counts, remat=remat, microbatches=microbatches, p2p=p2p, budget=budget)
    if sp is None:
        return None
    if _lockstep_1f1b(schedule):
        S, M = sp.stages, microbatches
        f = max(sp.f)
        b = max(ff + bb + rr for ff, bb, rr in zip(sp.f, sp.b, sp.r, strict=True))
        b += weight_pass_s
        span = (S - 1) * (f + p2p) + M * (f + b + 2 * p2p) + (S - 1) * (b + p2p)
        sp = dataclasses.replace(sp, makespan=span, finish=(span,) * S)
    return dataclasses.replace(sp, makespan=sp.makespan + head_s,
                               finish=tuple(f + head_s for f in sp.finish))


def spmd_head_s(cfg: ModelConfig, layout: Layout, hw: Hardware, strategy: LayerSpec,
                stages: int, schedule: str = SPMD) -> float:
    """An SPMD pipeline's head over the step, on every device at once: the last stage's
    outputs all-reduced over `stage` (and their gradients in the backward), then per
    micro-batch the final norm, logits and loss over this stage's 1/S of the vocabulary
    (`training.pipeline_spmd.vocab_part`; the whole vocabulary where the padded vocabulary
    does not split into S x tensor pieces), forward and backward (`head_cost`, whose embedding
    part, every device embedding all micro-batches, is counted in it). gpipe_spmd runs it
    after the forward ticks, checkpointed (its forward again in the backward: x 4/3), its two
    all-reduces over all M outputs; 1f1b_spmd inside each steady tick, two all-reduces of one
    micro-batch each."""
    head, _ = head_cost(cfg, layout, hw)
    split = stages if cfg.padded_vocab % (stages * layout.tensor) == 0 else 1
    M = layout.microbatches
    nbytes = stream_bytes(cfg, layout, strategy.schedule)
    group = layout.stage_group(stages)
    if _lockstep_1f1b(schedule):
        return M * (head / split + 2 * hw.comm_s("all-reduce", nbytes, group))
    return M * head * 4 / 3 / split + 2 * hw.comm_s("all-reduce", M * nbytes, group)


def spmd_weight_pass_s(cfg: ModelConfig, layout: Layout, hw: Hardware, stages: int) -> float:
    """What one 1f1b_spmd tick with a backward does over the stage's weights beyond its layers:
    it adds the stage's gradients into the float32 accumulator (a pass that reads it and the
    gradient and writes it: 3 x 4 B a local parameter) and transposes the stage's weights twice
    in the compute dtype (2 x 2 e B a parameter, FSDP's gathered). One steady tick of GPT-2 1.5B
    at stage=2,data=8, M=4 on h100:16 replayed at 39.3 ms against 31.6 priced without them: the
    two transpose fusions took 2.25 ms and the float32 adds 2.2 (these price 1.8 and 2.6).
    gpipe_spmd accumulates once, after its scan (`spmd_fixed` adds this to 1f1b_spmd only)."""
    blocks = cfg.param_count(embeddings=False) / stages / layout.tensor
    return hw.mem_s(3 * 4 * blocks / layout.fsdp) + hw.mem_s(2 * 2 * elem_bytes(cfg) * blocks)
