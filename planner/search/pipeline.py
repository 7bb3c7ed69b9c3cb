"""The 3D search: pipeline degree S on the slowest links, tensor inside a node, data between,
micro-batches, pipeline schedule and the balanced stages of `planner.search.stage_partition`, priced
by the layer cost model, the event simulator and alpha-beta transfers (docs/planner.md,
"3D search")."""

from __future__ import annotations

import dataclasses
import time

from oases_jax import registry as tp_registry
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.pipeline import registry as pipeline_registry
from oases_jax.planner.cost.layer_cost import LayerModel
from oases_jax.planner.cost.layer_work import elem_bytes, stream_bytes
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.primepar_cost import square_layouts
from oases_jax.planner.cost.stage_fsdp import FSDP_TP_STAGE_SCHEDULES, fsdp_layer_s
from oases_jax.planner.cost.step_cost import (
    StepTerms,
    head_cost,
    local_params,
    step_terms,
    update_s,
)
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.dense import divisors, strategies
from oases_jax.planner.search.spmd_stages import spmd_head_s, spmd_weight_pass_s, uniform_stages
from oases_jax.planner.search.stage_partition import StageInputs, StagePlan, fixed, partition

# The schedules the runtime runs; gpipe_spmd and 1f1b_spmd (no per-stage control flow) are
# offered where they run a layer strategy the tick executor cannot (the rings), or everywhere
# with `search_3d(spmd_everywhere=True)`: there they rank the GPT-2 1.5B h100:16 verification's
# six at Spearman 0.71 against 0.94 without (benchmarks/results/verify_3d_spmd_everywhere_*).
PIPELINES = pipeline_registry.names(runnable=True)  # the schedules the 3D search considers
MICROBATCH_FACTORS = (1, 2, 4, 8)  # M = S x factor
REFINE = 12  # screened candidates whose stages are partitioned under the simulator


@dataclasses.dataclass(frozen=True)
class PipelineCandidate:
    """A 3D plan: mesh stage x data x tensor (stage outermost), one layer strategy, the
    schedule and its stages, and what it costs (seconds, bytes per device)."""

    stages: int
    layout: Layout  # data x tensor and M micro-batches of one stage
    strategy: LayerSpec
    stage_plan: StagePlan
    step_s: float
    pipeline_s: float  # the simulated makespan of the micro-batches
    dp_reduce_s: float  # the longest stage's gradient reduction
    p2p_s: float
    peak_memory_bytes: float
    terms: StepTerms | None = None  # the step-level terms (`step_cost.step_terms`)

    def mesh(self) -> dict[str, int]:
        """stage, then the layout's own axes (data, tensor or primepar's tp_row x tp_col)."""
        return {"stage": self.stages} | {k: v for k, v in self.layout.mesh().items() if v > 1}

    def rules(self) -> str:
        """The rule set inside the stages (`Layout.rules`: fsdp, tp or dp here)."""
        return self.layout.rules()

    def summary(self) -> str:
        p = self.stage_plan
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh().items())
        chunks = f" v={p.chunks}" if p.chunks > 1 else ""
        mesh += " fsdp" if self.layout.fsdp > 1 else ""
        head = " split head" if p.split_head else ""
        return (f"{mesh} x{p.microbatches}mb {p.schedule}{chunks}{head} stages "
                f"{','.join(map(str, p.layers))} remat {','.join(map(str, p.remat))}: "
                f"{self.strategy.label()}")


# HBM passes a pipelined stage makes over the bytes each layer keeps for its backward
# (`LayerModel.saved_bytes`), beyond the scanned layer's own work: the forward zero-fills the
# layer scan's stacked output, writes it layer by layer and copies it into the residual pool;
# the backward reads it back out of the pool (oases_jax/pipeline/executor.py). Measured on the
# compiled F and B branches of GPT-2 1.5B (bf16, xla attention, h100:16, GPipe; stage=2,data=8,
# M=4, 24 layers a stage, and stage=4,data=4, M=8, 12 layers), per layer over the scanned
# program's forward and backward: 4.82 and 4.86 passes in F, 3.33 and 3.46 in B. (Before the
# block weights were cast once per step, `StageProgram.prepare`, every F and B branch re-cast
# its stage's weights, which these passes absorbed as 0.9 more each.)
RESIDUAL_STORE_PASSES = 4.85
RESIDUAL_LOAD_PASSES = 3.4
# With tensor parallelism inside the stages the compiled branches (the same GPipe programs with
# 20 heads, data=4,stage=2,tensor=2 and data=2,stage=2,tensor=4, after copy insertion by region
# analysis) spend fewer passes per kept byte of the layer model: 4.2-4.4 and 3.3 at tensor=2,
# 3.6-3.7 and 2.4-2.7 at tensor=4 (the middle of each range here; a larger degree takes 4's).
# Priced at tensor=1's they put tensor plans up to 9% high.
RESIDUAL_PASSES_BY_TENSOR = {1: (RESIDUAL_STORE_PASSES, RESIDUAL_LOAD_PASSES), 2: (4.3, 3.3),
                             4: (3.65, 2.55)}


def residual_passes(tensor: int) -> tuple[float, float]:
    """(store, load) passes per kept byte at this tensor degree inside the stages."""
    return RESIDUAL_PASSES_BY_TENSOR[max(t for t in RESIDUAL_PASSES_BY_TENSOR if t <= tensor)]


# The head split over the stages by positions (`--split-head on`, `training.pipeline_head`), as
# the search prices it: a phase every stage runs once a micro-batch in place of the last stage's
# head (docs/parallelism.md, "Split head").
#
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


def stage_inputs(cfg: ModelConfig, layout: Layout, hw: Hardware,
                 strategy: LayerSpec, pools: bool = True) -> StageInputs:
    """Per-layer costs and memory of one stage's device from the layer cost model: `strategy`
    (remat none) and its fully rematted twin; the head and loss (`head_cost`, one third forward)
    on the last stage. Static bytes per parameter: 16 (fp32 weight, gradient, AdamW moments),
    + 4 with an accumulator (M > 1), + e for the blocks' compute-dtype copy, over tensor.
    `pools`:
    the executor keeps residuals between ticks (not 1f1b_spmd, whose backward recomputes them
    inside its own `vjp`: no store and load passes)."""
    lm = LayerModel(cfg, layout, hw, gathered_stack=True)
    none, full = (dataclasses.replace(strategy, remat=r) for r in ("none", "full"))
    c0, c1 = lm.time(none), lm.time(full)
    # The executor's forward stores what a layer keeps in its pools and its backward loads it
    # (`residual_passes`). A recomputed layer's forward stores only its input (its saving is
    # `store_save`; priced as the whole before, GPT-2 1.5B with full remat as a one-stage
    # pipeline on one H200 was priced 23% above accumulation over the same micro-batches and
    # measured 0.8%). Its backward is priced as the layer model's rematted one, whose
    # recompute already nets out the activations it no longer reads: compiled, a rematted
    # stage's B branch costs 0.10-0.14 ms a layer over the plain one (GPT-2 1.5B, h100:16,
    # stage=2,data=8, M=4), the layer model's r 0.07 ms; taking the pool's load passes off too
    # priced it below the plain one.
    act, act_remat = c0.act_bytes, c1.act_bytes
    store_passes, load_passes = residual_passes(layout.tensor)

    def store(nbytes):
        return hw.mem_s(store_passes * nbytes) if pools else 0.0

    def load(nbytes):
        return hw.mem_s(load_passes * nbytes) if pools else 0.0

    store_s = store(act)
    head_s, head_temp = head_cost(cfg, layout, hw)
    per_param = 16 + (4 if layout.microbatches > 1 else 0)
    e = elem_bytes(cfg)
    blocks = cfg.param_count(embeddings=False)
    shared = cfg.param_count() - blocks
    t, f = layout.tensor, layout.fsdp
    fsdp_f, fsdp_b, gathered = (fsdp_layer_s(cfg, layout, hw, c0.fwd_s, c0.bwd_s) if f > 1
                                else (0.0, 0.0, 0.0))
    return StageInputs.uniform(
        cfg.n_layers, f=c0.fwd_s + store_s + fsdp_f, b=c0.bwd_s + load(act) + fsdp_b,
        r=max(c1.bwd_s - c0.bwd_s, 0.0),
        act=act, act_remat=act_remat, temp=c0.temp_bytes, temp_remat=c1.temp_bytes,
        store=store_s, store_save=store_s - store(act_remat),
        block_bytes=(per_param + (e if e < 4 else 0)) * blocks / cfg.n_layers / t / f + gathered,
        shared_bytes=per_param * shared / t / f, last_f=head_s / 3, last_b=2 * head_s / 3,
        last_temp=head_temp, shared=hw.shared_cores())


def transfer_s(cfg: ModelConfig, layout: Layout, hw: Hardware, strategy: LayerSpec,
               stages: int) -> float:
    """One stage-to-stage activation (or gradient) of a micro-batch: T D e bytes per device
    (/t when the residual stream is sequence-sharded) between devices D t apart (stage is the
    outermost mesh axis), priced by the alpha-beta model of the slowest link any stage's pair
    crosses: every pair moves in the same permute, which ends with the slowest (stage=4 over two
    8-GPU nodes with data=4: one pair of the four crosses InfiniBand, and the compiled tick's
    permutes take its time, 0.30 ms a tick against 0.04 priced on NVLink)."""
    if stages == 1:
        return 0.0
    return hw.comm_s("collective-permute", stream_bytes(cfg, layout, strategy.schedule),
                     layout.stage_group(stages))


def price(cfg: ModelConfig, hw: Hardware, stages: int, layout: Layout, strategy: LayerSpec,
          sp: StagePlan, x: StageInputs, p2p: float) -> PipelineCandidate:
    """The step: each stage's gradient all-reduce over its data group starts when the stage
    finishes its last backward (the simulator's per-stage finish), plus the embedding/head
    gradients summed over `stage`, then the step-level terms every step model adds
    (`step_cost.step_terms`: FSDP's clip, AdamW, the accumulation passes; the head is in the
    last stage's, or every stage's, ticks):
        step = max_s (finish_s + reduce_s) + stage_sum + clip + update + M x accumulate
    (`update_s` counts the blocks' once-per-step cast to the compute dtype, which
    `StageProgram.prepare` does before the tick loop)."""
    local = local_params(cfg, layout, max(sp.layers))
    # Under FSDP (data = 1) the group is one device: the gradients were reduced inside the
    # branches (`fsdp_layer_s`).
    group = [i * layout.tensor for i in range(layout.data)]
    terms = step_terms(cfg, layout, hw, local=local,
                       reduce_s=hw.comm_s("all-reduce", 4 * local, group))
    shared_params = local_params(cfg, layout, 0)
    stage_sum = hw.comm_s("all-reduce", 4 * shared_params, layout.stage_group(stages))
    end = max(fin + terms.exposed_reduce_s for fin in sp.finish)
    step = end + stage_sum + terms.clip_s + terms.update_s + terms.accumulate_s
    return PipelineCandidate(stages, layout, strategy, sp, step, sp.makespan, terms.reduce_s,
                             p2p, max(sp.memory), terms)


def _screen(cfg, hw, stages, layout, strategy, x, p2p, schedule) -> float:
    """A quick estimate from the uniform split: (M + (S-1)/v) x the heaviest stage's load, plus
    its data-parallel reduction and optimizer step."""
    L, S, M = cfg.n_layers, stages, layout.microbatches
    base, extra = divmod(L, S)
    counts = [base + (i < extra) for i in range(S)]
    loads, i = [], 0
    for s, n in enumerate(counts):
        load = sum(x.f[i:i + n]) + sum(x.b[i:i + n]) + (x.last_f + x.last_b) * (s == S - 1) \
            + x.head_phase
        loads.append(load)
        i += n
    v = pipeline_registry.get(schedule).chunks
    # Plus what `price` adds after the pipeline: the heaviest stage's gradient all-reduce over
    # its data group and the optimizer passes (these decide between S, data and tensor degrees).
    local = local_params(cfg, layout, counts[0])
    reduce = hw.comm_s("all-reduce", 4 * local, [i * layout.tensor for i in range(layout.data)])
    return (M + (S - 1) / v) * (max(loads) + 2 * p2p) + reduce + update_s(cfg, local, hw)


def search_3d(cfg: ModelConfig, hw: Hardware, *, global_batch: int, seq_len: int,
              memory_fraction: float | None = None, n_devices: int | None = None,
              pipelines: tuple[str, ...] = PIPELINES, refine: int = REFINE,
              megatron_only: bool = False, baseline: bool = True,
              spmd_everywhere: bool = False) -> list[PipelineCandidate]:
    """Every S >= 2 dividing the devices and at most the layers, tensor t inside a node
    (dividing heads, KV heads, MLP and vocabulary), data the rest, M = S x {1, 2, 4, 8} dividing
    the per-replica batch, each schedule; the fastest non-rematted layer strategy per layout
    (`megatron_only`: Megatron's); screened by the uniform split's bubble estimate, the best
    `refine` partitioned under the simulator (the SPMD pipelines where a ring strategy is the
    fastest, or with `spmd_everywhere` on every layout); plus (`baseline`) the best
    Megatron-style plan (`megatron_3d`), which the screen may rank out. Ranked best first."""
    n = n_devices or hw.cluster.n_devices
    budget = hw.memory_budget(memory_fraction)
    screened = []
    for S, layout, _ in _layouts(cfg, hw, n, global_batch, seq_len, fsdp=not megatron_only,
                                 square=not megatron_only):
        strategy = _strategy(cfg, layout, hw, megatron_only)  # None on a primepar square
        if strategy is None and not layout.primepar:
            continue
        x_tick = stage_inputs(cfg, layout, hw, strategy) if strategy is not None else None
        p2p = transfer_s(cfg, layout, hw, strategy, S) if strategy is not None else 0.0
        for sch in pipelines:
            spec = pipeline_registry.get(sch)
            if spec.chunked and (S < 2 or cfg.n_layers % (spec.chunks * S)):
                continue
            if spec.equal_stages:
                ring = _strategy(cfg, layout, hw, megatron_only, anywhere=True)
                if ring is None \
                        or (not tp_registry.get(ring.schedule).permutes and not spmd_everywhere) \
                        or cfg.n_layers % S \
                        or (layout.primepar and spec.executor == "spmd_1f1b") \
                        or layout.rules() == "fsdp_tp":
                    # The tick executor's gpipe runs it already, or unequal stages; the square
                    # under 1f1b_spmd compiles 13% slower than priced (docs/planner.md); fsdp_tp
                    # under the SPMD pipelines is not checked against a compiled program.
                    continue
                every = spec.recompute == "every"  # each backward recomputes its stage
                xs, p2p_ring = stage_inputs(cfg, layout, hw, ring, pools=not every), \
                    transfer_s(cfg, layout, hw, ring, S)
                est = _screen(cfg, hw, S, layout, ring, xs, p2p_ring, sch)
                if every:
                    est += (layout.microbatches + S - 1) * sum(xs.f[:cfg.n_layers // S])
                screened.append((est, S, layout, ring, xs, p2p_ring, sch))
                continue
            if strategy is None:
                continue  # the square's permutes cannot sit in the tick executor's switch
            # The head on the last stage and split over the stages (`--split-head`): screened
            # by the faster; both partitioned where their screens are within SPLIT_HEAD_MARGIN
            # (the screen knows no fused ticks, which only the last stage's head allows).
            ests = sorted(((_screen(cfg, hw, S, layout, strategy, x, p2p, sch), i, x)
                           for i, x in enumerate((x_tick, split_head_inputs(
                               cfg, layout, hw, strategy, x_tick, S))) if x is not None),
                          key=lambda e: e[:2])
            xs = [x for est, _, x in ests if est <= ests[0][0] * (1 + SPLIT_HEAD_MARGIN)]
            screened.append((ests[0][0], S, layout, strategy, xs, p2p, sch))
    screened.sort(key=lambda c: c[0])
    out, tried = [], 0
    for _, S, layout, strategy, x, p2p, sch in screened:
        # `refine` partitions that fit (the screen ignores memory), at most 3 x refine tries.
        if len(out) >= refine or tried >= 3 * refine:
            break
        tried += 1
        if pipeline_registry.get(sch).equal_stages:
            sp = uniform_stages(x, S, layout.microbatches, p2p, budget,
                                spmd_head_s(cfg, layout, hw, strategy, S, sch), sch,
                                spmd_weight_pass_s(cfg, layout, hw, S))
        else:
            fits = [(sp, xi) for xi in x for sp in [partition(
                xi, schedule=sch, stages=S, microbatches=layout.microbatches,
                chunks=pipeline_registry.get(sch).chunks, p2p=p2p, budget=budget,
                max_leaves=60, max_sims=10)] if sp is not None]
            sp, x = min(fits, key=lambda f: f[0].makespan, default=(None, None))
        if sp is not None:
            out.append(price(cfg, hw, S, layout, strategy, sp, x, p2p))
    if baseline:  # Megatron's plans are in the space: never return one slower than its best
        out += megatron_3d(cfg, hw, global_batch=global_batch, seq_len=seq_len,
                           memory_fraction=memory_fraction, n_devices=n)[:1]
    return sorted(out, key=lambda c: c.step_s)


def megatron_3d(cfg: ModelConfig, hw: Hardware, *, global_batch: int, seq_len: int,
                memory_fraction: float | None = None, n_devices: int | None = None,
                refine: int = 2 * REFINE) -> list[PipelineCandidate]:
    """Megatron-LM's 3D plan, searched over the same degrees as `search_3d`: uniform stages
    (the remainder on the first stages), 1F1B, full recompute on every stage, Megatron's
    tensor parallelism inside a node; screened by (M + S - 1) x the heaviest stage, the best
    `refine` simulated. Ranked best first; [] when none fits."""
    n = n_devices or hw.cluster.n_devices
    budget = hw.memory_budget(memory_fraction)
    screened = []
    for S, layout, _ in _layouts(cfg, hw, n, global_batch, seq_len):
        strategy = LayerSpec(schedule="megatron")
        x = stage_inputs(cfg, layout, hw, strategy)
        p2p = transfer_s(cfg, layout, hw, strategy, S)
        base, extra = divmod(cfg.n_layers, S)
        counts = [base + (i < extra) for i in range(S)]
        # 1F1B with uniform stages: about (M + S - 1) x the heaviest stage, recompute included.
        heavy = max(x.f[0] + x.b[0] + x.r[0], 0.0) * counts[0] + x.last_f + x.last_b
        est = (layout.microbatches + S - 1) * (heavy + 2 * p2p)
        screened.append((est, S, layout, strategy, x, p2p, counts))
    screened.sort(key=lambda c: c[0])
    out = []
    for _, S, layout, strategy, x, p2p, counts in screened[:refine]:
        sp = fixed(x, schedule="1f1b", counts=counts, remat=counts,
                   microbatches=layout.microbatches, p2p=p2p, budget=budget)
        if sp is not None:
            out.append(price(cfg, hw, S, layout, strategy, sp, x, p2p))
    return sorted(out, key=lambda c: c.step_s)


def _layouts(cfg: ModelConfig, hw: Hardware, n: int, global_batch: int, seq_len: int,
             fsdp: bool = False, square: bool = False):
    """(S, layout, t) of every S >= 2, tensor degree inside a node dividing the model's heads,
    KV heads, MLP and vocabulary, data the rest, M = S x {1, 2, 4, 8} dividing the per-replica
    batch; with `fsdp`, also FSDP over the replicas (`fsdp_tp` where tensor > 1); with `square`,
    PrimePar's q x q squares inside a node (`square_layouts`)."""
    node = hw.cluster.devices_per_node
    for S in divisors(n):
        if S < 2 or S > cfg.n_layers:
            continue
        if square:
            for lay in square_layouts(cfg, n // S, global_batch, seq_len, 8 * S):
                if lay.tensor <= node and lay.microbatches in (S * f for f in
                                                               MICROBATCH_FACTORS):
                    yield S, lay, lay.tensor
        for t in divisors(n // S):
            if t > node or cfg.n_heads % t or cfg.kv_heads % t or cfg.ff_dim % t \
                    or cfg.padded_vocab % t:
                continue
            d = n // (S * t)
            if global_batch % d:
                continue
            for factor in MICROBATCH_FACTORS:
                M = S * factor
                if (global_batch // d) % M:
                    continue
                yield S, Layout(data=d, tensor=t, microbatches=M, global_batch=global_batch,
                                seq_len=seq_len), t
                if fsdp and d > 1:
                    # FSDP inside the stages (`--rules fsdp`, with tensor > 1 `fsdp_tp`).
                    yield S, Layout(fsdp=d, tensor=t, microbatches=M,
                                    global_batch=global_batch, seq_len=seq_len), t


def _strategy(cfg, layout, hw, megatron_only: bool, anywhere: bool = False
              ) -> LayerSpec | None:
    """The fastest layer strategy without remat (the partitioner adds recompute per stage)
    that the tick executor runs inside its stages (`anywhere`: any, as the SPMD pipelines
    do; on a primepar square that is PrimePar alone). Under fsdp_tp inside the stages only
    GSPMD's schedules (FSDP_TP_STAGE_SCHEDULES)."""
    fsdp_tp = layout.rules() == "fsdp_tp"
    opts = [s for s in strategies(layout, remats=("none",))
            if (anywhere or not tp_registry.get(s.schedule).permutes)
            and (not fsdp_tp or s.schedule in FSDP_TP_STAGE_SCHEDULES)
            and (not megatron_only or s.schedule == "megatron")]
    if not opts:
        return None
    lm = LayerModel(cfg, layout, hw, gathered_stack=True)
    return min(opts, key=lambda s: lm.time(s).step_s)


def timed_search(cfg: ModelConfig, hw: Hardware, **kw) -> tuple[list[PipelineCandidate], float]:
    t0 = time.perf_counter()
    out = search_3d(cfg, hw, **kw)
    return out, time.perf_counter() - t0
