"""The 3D search: transfers and the step formula by hand, the chosen stages balanced, and its
plan's stage section through the schema to the runtime's ParallelConfig."""

import dataclasses

import pytest

from oases_jax.errors import UserError
from oases_jax.hardware import get_cluster
from oases_jax.models.presets import get_preset
from oases_jax.planner import plan as plans
from oases_jax.planner.cost.layer_work import elem_bytes
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import head_cost
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.dense import LayerSpec
from oases_jax.planner.search.pipeline import (
    PIPELINES,
    megatron_3d,
    price,
    residual_passes,
    search_3d,
    split_head_inputs,
    stage_inputs,
    transfer_s,
)
from oases_jax.planner.search.spmd_stages import spmd_fixed, spmd_head_s
from oases_jax.planner.search.stage_partition import fixed, partition, simulate

CFG = get_preset("gpt2-1.5b")


def hw(name):
    return Hardware.of(get_cluster(name))


def test_transfer_crosses_one_node_boundary_by_alpha_beta():
    """stage=8, data=2, tensor=4 on v100-64 (nodes of 4): neighbours are 8 devices apart, one
    InfiniBand hop: bytes / B + alpha. With data=1, tensor=2 two stages share a node (NVLink),
    but eight span four nodes: every pair moves in one permute, which waits for the pairs that
    cross InfiniBand."""
    h = hw("v100-64")
    lay = Layout(data=2, tensor=4, microbatches=8, global_batch=128, seq_len=1024)
    spec = LayerSpec(schedule="megatron")
    e = elem_bytes(CFG)
    nbytes = 128 // 16 * 1024 * CFG.d_model * e  # rows x L x D x e
    ib = h.cluster.levels[-1][1]
    assert transfer_s(CFG, lay, h, spec, 8) == pytest.approx(nbytes / ib.bytes_per_s
                                                             + ib.latency_s)
    near = Layout(data=1, tensor=2, microbatches=8, global_batch=128, seq_len=1024)
    nv = h.cluster.levels[0][1]
    near_bytes = near.rows * 1024 * CFG.d_model * e
    assert transfer_s(CFG, near, h, spec, 2) == pytest.approx(
        near_bytes / nv.bytes_per_s + nv.latency_s)
    assert transfer_s(CFG, near, h, spec, 8) == pytest.approx(
        near_bytes / ib.bytes_per_s + ib.latency_s)


def test_step_is_latest_stage_finish_plus_its_reduction():
    h = hw("h100-64")
    lay = Layout(data=4, tensor=4, microbatches=16, global_batch=128, seq_len=1024)
    spec = LayerSpec(schedule="megatron")
    x = stage_inputs(CFG, lay, h, spec)
    sp = partition(x, schedule="1f1b", stages=4, microbatches=16, p2p=0.0)
    c = price(CFG, h, 4, lay, spec, sp, x, 0.0)
    local = (max(sp.layers) * x.block_bytes + x.shared_bytes) / 20
    reduce = h.comm_s("all-reduce", 4 * local, [0, 4, 8, 12])
    assert c.dp_reduce_s == pytest.approx(reduce)
    assert c.step_s > max(f + reduce for f in sp.finish)
    assert c.pipeline_s == sp.makespan
    # the first stage finishes last under 1F1B (its final backward ends the step)
    assert sp.finish[0] == max(sp.finish)


@pytest.mark.parametrize("stages", [4, 8])
def test_gpt2_partition_beats_the_uniform_split(stages):
    """GPT-2 1.5B (48 layers + a 50k head of about 0.63 layer, the layers' residual stores
    included) on h100-64: the simulated step is no longer than the uniform split's, and the
    heaviest stage is within one layer of the least bottleneck whole layers allow (ceil of the
    mean in layers). Uniform is the best whole-layer split here: max/mean 12.63 / 12.16 = 1.039
    at S=4, 6.63 / 6.08 = 1.09 at S=8 (1.05 needs a split layer)."""
    h = hw("h100-64")
    M = 2 * stages
    lay = Layout(data=16 // stages * 2, tensor=2, microbatches=M, global_batch=256,
                 seq_len=1024)
    x = stage_inputs(CFG, lay, h, LayerSpec(schedule="megatron"))
    sp = partition(x, schedule="1f1b", stages=stages, microbatches=M, max_sims=24)
    n, c = 48 // stages, x.f[0] + x.b[0]
    f = [n * x.f[0]] * (stages - 1) + [n * x.f[0] + x.last_f]
    b = [n * x.b[0]] * (stages - 1) + [n * x.b[0] + x.last_b]
    assert sp.makespan <= simulate("1f1b", M, 1, f, b, [0.0] * stages)[0] * (1 + 1e-12)
    mean_layers = (48 + (x.last_f + x.last_b) / c) / stages
    assert max(sp.loads) <= (-(-mean_layers // 1) + 1) * c * (1 + 1e-9)
    assert sp.layers[-1] <= n


@pytest.mark.parametrize("stages", [4, 8])
def test_gpt2_split_head_balances_the_stages(stages):
    """With the head split over the stages by positions (`--split-head on`), GPT-2 1.5B's
    stages on h100-64 balance within 1.05 (uniform: 1.000) where whole layers with the head on
    the last stage allow 1.039 at S=4 and 1.09 at S=8, and the step is shorter: each
    micro-batch's phase (head / S, a reduce-scatter and an all-gather of the last stage's
    output over `stage`) costs less than the head on one stage. The phase is priced by hand."""
    h = hw("h100-64")
    M = 2 * stages
    lay = Layout(data=16 // stages * 2, tensor=2, microbatches=M, global_batch=256,
                 seq_len=1024)
    spec = LayerSpec(schedule="megatron")
    x = stage_inputs(CFG, lay, h, spec)
    xs = split_head_inputs(CFG, lay, h, spec, x, stages)
    head_s, _ = head_cost(CFG, lay, h)
    nbytes = lay.rows * 1024 * CFG.d_model * 4  # fp32 stream, not sequence-sharded
    group = [s * lay.replicas * 2 for s in range(stages)]
    assert xs.head_phase == pytest.approx(head_s / stages + h.comm_s("reduce-scatter", nbytes,
                                                                     group)
                                          + h.comm_s("all-gather", nbytes, group))
    assert (xs.last_f, xs.last_b) == (0.0, 0.0) and xs.head_phase < x.last_f + x.last_b
    p2p = transfer_s(CFG, lay, h, spec, stages)
    whole = partition(x, schedule="1f1b", stages=stages, microbatches=M, p2p=p2p, max_sims=24)
    split = partition(xs, schedule="1f1b", stages=stages, microbatches=M, p2p=p2p, max_sims=24)
    assert split.balance <= 1.05 < whole.balance + 0.02
    assert split.makespan < whole.makespan
    assert split.split_head

    def step(phase):
        return simulate("1f1b", M, 1, split.f, split.b, split.r, p2p, k=1,
                        fuse=split.fused_ticks, head=phase)[0]

    assert split.makespan == pytest.approx(step(xs.head_phase))
    # M phases a step, one after the tick of each last-stage forward
    assert step(2 * xs.head_phase) - step(xs.head_phase) == pytest.approx(M * xs.head_phase)


def test_gpt2_spmd_stages_balanced_with_the_head_split():
    """Under gpipe_spmd the head leaves the ticks (split over the stages by vocabulary, run
    between the forward and backward ticks), so GPT-2 1.5B's equal stages at S=8 are balanced
    exactly where whole layers with the head on the last stage allow only 1.09, and every
    stage finishes the same head phase later than the tick table says."""
    h = hw("h100-64")
    lay = Layout(data=4, tensor=2, microbatches=16, global_batch=256, seq_len=1024)
    spec = LayerSpec(schedule="megatron")
    x = stage_inputs(CFG, lay, h, spec)
    head = spmd_head_s(CFG, lay, h, spec, 8)
    sp = spmd_fixed(x, [6] * 8, [0] * 8, 16, 0.0, float("inf"), head)
    assert sp.balance == pytest.approx(1.0)
    one = partition(x, schedule="1f1b", stages=8, microbatches=16, max_sims=24)
    assert one.balance > 1.08
    ticks = fixed(dataclasses.replace(x, last_f=0.0, last_b=0.0), schedule="gpipe_spmd",
                  counts=[6] * 8, remat=[0] * 8, microbatches=16)
    assert sp.finish == pytest.approx([f + head for f in ticks.finish])


def test_search_and_plan_section_round_trip():
    h = hw("h100-64")
    out = search_3d(CFG, h, global_batch=128, seq_len=1024)
    assert out and out == sorted(out, key=lambda c: c.step_s)
    best = out[0]
    assert best.stage_plan.schedule in PIPELINES
    assert best.peak_memory_bytes <= 0.9 * h.cluster.device_spec.memory_bytes
    assert best.layout.tensor <= h.cluster.devices_per_node
    d = plans.pipeline_plan_json(best, model="gpt2-1.5b", cfg=CFG, cluster="h100-64",
                                 cost_source="datasheet", search_s=0.1,
                                 alternatives=out[1:3])
    p = plans.from_json(d)
    par = p.parallel()
    assert par.pipeline.schedule == best.stage_plan.schedule and par.layers is None
    assert par.pipeline.stage_layers == best.stage_plan.layers
    assert p.microbatches == best.layout.microbatches
    # The plan spans each backward over the ticks it was priced with, on the (fused or not)
    # tick table it was priced with, and the run reads both; a plan without the fields runs
    # the runtime's rule.
    sp = best.stage_plan
    assert par.pipeline.backward_ticks == sp.backward_ticks == d["pipeline"]["backward_ticks"] >= 1
    assert d["pipeline"]["fused_ticks"] == sp.fused_ticks
    assert par.pipeline.fused_ticks == sp.fused_ticks
    # So does its head: on the last stage or split over the stages (`--split-head`).
    assert d["pipeline"]["split_head"] == sp.split_head
    assert par.pipeline.split_head == sp.split_head
    assert sp.makespan == pytest.approx(simulate(sp.schedule, sp.microbatches, sp.chunks, sp.f,
                                                 sp.b, sp.r, sp.p2p, k=sp.backward_ticks,
                                                 fuse=sp.fused_ticks, ends=sp.ends,
                                                 head=sp.head_phase)[0])
    assert par.layers is None  # one strategy: the runtime's default for every layer
    # A plan whose layers differ runs each layer's own strategy inside the stages.
    mixed = dict(d, layers=[{"schedule": "oases", "sub_batches": 2, "remat": "none"}]
                 + d["layers"][1:])
    got = plans.from_json(mixed).parallel()
    assert got.layers is not None and got.layers[0] == LayerSpec(schedule="oases",
                                                                 sub_batches=2)
    assert got.layers[1:] == tuple(p.layers[1:]) and got.pipeline == par.pipeline
    split = dict(d, pipeline=dict(d["pipeline"], backward_ticks=3, fused_ticks=False))
    assert plans.from_json(split).parallel().pipeline.backward_ticks == 3
    legacy = dict(d, pipeline={k: v for k, v in d["pipeline"].items()
                               if k not in ("backward_ticks", "fused_ticks")})
    assert plans.from_json(legacy).parallel().pipeline.backward_ticks == 0
    assert plans.from_json(legacy).parallel().pipeline.fused_ticks is None  # auto
    bad = dict(d, pipeline=dict(d["pipeline"], stage_layers=[1] * best.stages))
    with pytest.raises(UserError, match="sum to the plan's 48 layers"):
        plans.from_json(bad)
    old = {k: v for k, v in d.items() if k != "pipeline"}
    with pytest.raises(UserError, match="stage axis but the plan has no pipeline"):
        plans.from_json(old)


def test_plans_without_a_stage_section_still_load():
    d = {"format": "oases-jax-plan/1", "version": 1, "global_batch": 16, "seq_len": 128,
         "mesh": {"data": 2, "tensor": 4}, "rules": "tp", "microbatches": 1,
         "layers": [{"schedule": "megatron"}] * 2}
    p = plans.from_json(d)
    assert p.parallel().pipeline is None


def test_megatron_baseline_uses_megatron_layers():
    out = search_3d(dataclasses.replace(CFG), hw("v100-64"), global_batch=128, seq_len=1024,
                    megatron_only=True, pipelines=("1f1b",), refine=3)
    assert out and all(c.strategy.schedule == "megatron" for c in out)


def test_megatron_3d_is_uniform_1f1b_full_recompute_and_never_beats_the_search():
    """Megatron's plan: uniform stages (remainder first), 1F1B, every layer recomputed,
    Megatron layers; the 3D search includes it, so its best is never slower."""
    cfg, h = dataclasses.replace(CFG), hw("h100-64")
    meg = megatron_3d(cfg, h, global_batch=128, seq_len=1024)
    assert meg
    for c in meg:
        sp = c.stage_plan
        assert sp.schedule == "1f1b" and sp.remat == sp.layers
        assert max(sp.layers) - min(sp.layers) <= 1 and sp.layers == tuple(sorted(sp.layers,
                                                                               reverse=True))
        assert c.strategy.schedule == "megatron" and sp.r[0] > 0
    ours = search_3d(cfg, h, global_batch=128, seq_len=1024)
    assert ours[0].step_s <= meg[0].step_s


def test_fixed_partition_agrees_with_the_partitioner():
    """`fixed` on the partitioner's own choice gives the partitioner's step and memory."""
    cfg, h = dataclasses.replace(CFG), hw("v100-64")
    layout = Layout(data=4, tensor=4, microbatches=8, global_batch=64, seq_len=1024)
    strategy = LayerSpec(schedule="megatron")
    x = stage_inputs(cfg, layout, h, strategy)
    sp = partition(x, schedule="1f1b", stages=4, microbatches=8)
    again = fixed(x, schedule="1f1b", counts=sp.layers, remat=sp.remat, microbatches=8)
    assert again.makespan == pytest.approx(sp.makespan)
    assert again.memory == pytest.approx(sp.memory)
    assert fixed(x, schedule="1f1b", counts=sp.layers, remat=sp.remat, microbatches=8,
                 budget=0.5 * min(sp.memory)) is None


def test_fsdp_inside_the_stages_by_hand():
    """FSDP over the replicas inside the stages (`--rules fsdp`): the fp32 state of a stage
    sharded over them, the stage's weights gathered whole in the compute dtype, each layer's
    forward and backward lengthened by its exposed gathers and its gradients' all-reduce
    (`fsdp_layer_s`), no gradient all-reduce after the loop; the plan names rules fsdp on a
    `data` axis."""
    from oases_jax.planner.cost.layer_cost import LayerModel
    from oases_jax.planner.cost.layer_work import layer_matrices
    from oases_jax.planner.cost.stage_fsdp import FSDP_BWD_HIDDEN, FSDP_FWD_HIDDEN
    from oases_jax.planner.cost.step_cost import fsdp_collectives

    cfg, h = CFG.replace(dtype="bfloat16"), hw("h100:16")
    spec = LayerSpec(schedule="megatron")
    kw = {"microbatches": 4, "global_batch": 32, "seq_len": 1024}
    dp, fs = Layout(data=8, **kw), Layout(fsdp=8, **kw)
    x0, x1 = stage_inputs(cfg, dp, h, spec), stage_inputs(cfg, fs, h, spec)
    cost = LayerModel(cfg, fs, h, gathered_stack=True).time(
        LayerSpec(schedule="megatron", remat="none"))
    ag_a, ag_m, ar = fsdp_collectives(cfg, fs, h, reduce="all-reduce")
    assert ar > fsdp_collectives(cfg, fs, h)[2]  # an all-reduce moves more than a scatter
    assert x1.f[0] - x0.f[0] == pytest.approx(max(0.0, ag_a + ag_m
                                                  - FSDP_FWD_HIDDEN * cost.fwd_s))
    assert x1.b[0] - x0.b[0] == pytest.approx(max(0.0, ar - FSDP_BWD_HIDDEN * cost.bwd_s))
    assert x1.b[0] > x0.b[0]  # GPT-2 1.5B at one row: the all-reduce is not all hidden
    per_layer = cfg.param_count(embeddings=False) / cfg.n_layers
    assert x1.block_bytes == pytest.approx((20 + 2) * per_layer / 8
                                           + 2 * sum(layer_matrices(cfg)))
    assert x1.shared_bytes == pytest.approx(x0.shared_bytes / 8)
    sps = [fixed(x, schedule="gpipe", counts=[24, 24], remat=[0, 0], microbatches=4, p2p=0.0)
           for x in (x0, x1)]
    c0, c1 = (price(cfg, h, 2, lay, spec, sp, x, 0.0)
              for lay, sp, x in ((dp, sps[0], x0), (fs, sps[1], x1)))
    assert c0.dp_reduce_s > 0 and c1.dp_reduce_s == 0
    assert c1.peak_memory_bytes < c0.peak_memory_bytes
    assert (c0.mesh(), c0.rules()) == ({"stage": 2, "data": 8}, "dp")
    assert (c1.mesh(), c1.rules()) == ({"stage": 2, "data": 8}, "fsdp")
    d = plans.pipeline_plan_json(c1, model="gpt2-1.5b", cfg=cfg, cluster="h100:16",
                                 cost_source="datasheet", search_s=0.1)
    par = plans.from_json(d).parallel()
    assert (par.mesh, par.rules, par.pipeline.schedule) == ("stage=2,data=8", "fsdp", "gpipe")


def test_the_search_offers_fsdp_inside_the_stages():
    """FSDP layouts join the search (GPT-2 1.5B's 25 heads leave only tensor = 1 on h100:16, so
    rules fsdp; with tensor > 1, fsdp_tp: `test_search_offers_fsdp_tp_inside_stages_...`);
    Megatron-LM's baseline has none."""
    cfg, h = CFG.replace(dtype="bfloat16"), hw("h100:16")
    out = search_3d(cfg, h, global_batch=32, seq_len=1024, refine=40)
    fsdp = [c for c in out if c.layout.fsdp > 1]
    assert fsdp and all(c.layout.tensor == 1 and c.rules() == "fsdp" for c in fsdp)
    assert all(c.layout.fsdp == 1 for c in megatron_3d(cfg, h, global_batch=32, seq_len=1024))


def _ring_plans(pipeline: str):
    """(model, hardware, the 3D search's plans under `pipeline` alone): `oases-h4096-l16` on
    `3090-pcie-32`, where `collective_matmul` at tensor=2 wins."""
    cfg, h = get_preset("oases-h4096-l16"), hw("3090-pcie-32")
    cands = search_3d(cfg, h, global_batch=32, seq_len=1024, pipelines=(pipeline,),
                      baseline=False)
    assert cands
    cands = [c for c in cands if not c.layout.primepar]  # its squares: test_primepar_...
    for c in cands:
        sp = c.stage_plan
        assert sp.schedule == pipeline and c.strategy.schedule == "collective_matmul"
        assert len(set(sp.layers)) == 1 and set(sp.remat) in ({0}, {sp.layers[0]})
    return cfg, h, cands


def test_primepar_squares_inside_the_spmd_stages():
    """PrimePar's q x q squares join the 3D search under gpipe_spmd only (the square's permutes
    cannot sit in the tick executor's switch, and under 1f1b_spmd it compiles 13% slower than
    priced); a square's stage transfer moves its rows/q x D/q per device, and its plan runs
    gpipe_spmd with the primepar rules and schedule on stage x data x tp_row x tp_col."""
    cfg, h = CFG.replace(dtype="bfloat16", n_heads=20), hw("h100:16")  # 20 heads split by q=2
    out = search_3d(cfg, h, global_batch=32, seq_len=1024, pipelines=("gpipe_spmd", "1f1b_spmd"),
                    refine=200, baseline=False)
    squares = [c for c in out if c.layout.primepar]
    assert squares and all(c.strategy.schedule == "primepar" for c in squares)
    assert {c.stage_plan.schedule for c in squares} == {"gpipe_spmd"}
    assert not any(c.layout.primepar for c in search_3d(
        cfg, h, global_batch=32, seq_len=1024, pipelines=("1f1b",), refine=200, baseline=False))
    c = squares[0]
    lay, S, q = c.layout, c.stages, c.layout.square
    nbytes = lay.rows / q * 1024 * cfg.d_model * 2 / q  # bf16
    span = lay.replicas * lay.tensor
    assert c.p2p_s == pytest.approx(
        h.comm_s("collective-permute", nbytes, [s * span for s in range(S)]))
    d = plans.pipeline_plan_json(c, model="gpt2-1.5b", cfg=cfg, cluster="h100:16",
                                 cost_source="datasheet", search_s=0.1)
    par = plans.from_json(d).parallel()
    data = f"data={lay.data}," if lay.data > 1 else ""
    assert (par.mesh, par.rules, par.schedule, par.pipeline.schedule) == (
        f"stage={S},{data}tp_row={q},tp_col={q}", "primepar", "primepar", c.stage_plan.schedule)


def test_gpipe_spmd_is_offered_where_a_ring_wins():
    """gpipe_spmd runs the rings inside the stages: the search offers it only with a layer
    strategy the tick executor cannot run (oases-h4096-l16 on 3090-pcie-32 at tensor=2:
    collective_matmul), on equal stages, every layer recomputed or none, priced as GPipe's
    table; its plan runs gpipe_spmd with the model's remat and no per-stage flags."""
    cfg, h, cands = _ring_plans("gpipe_spmd")
    for c in cands:
        sp = c.stage_plan
        # GPipe's table without the head in its ticks, then the head on every device: all M
        # micro-batches' outputs all-reduced over the S stages each way, and the head's
        # forward, recompute and backward over 1/S of the vocabulary.
        x = dataclasses.replace(stage_inputs(cfg, c.layout, h, c.strategy), last_f=0.0,
                                last_b=0.0)
        gpipe = fixed(x, schedule="gpipe", counts=sp.layers, remat=sp.remat,
                      microbatches=sp.microbatches, p2p=c.p2p_s)
        S, M, lay = len(sp.layers), sp.microbatches, c.layout
        # fp32; collective_matmul keeps the residual stream split over tensor.
        outs = M * lay.rows * 1024 * cfg.d_model * 4 / lay.tensor
        span = lay.replicas * lay.tensor
        head = M * head_cost(cfg, lay, h)[0] * 4 / 3 / S \
            + 2 * h.comm_s("all-reduce", outs, [s * span for s in range(S)])
        assert cfg.padded_vocab % (S * lay.tensor) == 0
        assert sp.makespan == pytest.approx(gpipe.makespan + head)
        assert sp.finish == pytest.approx([f + head for f in gpipe.finish])
    c = cands[0]
    d = plans.pipeline_plan_json(c, model="oases-h4096-l16", cfg=cfg, cluster="3090-pcie-32",
                                 cost_source="model", search_s=0.0)
    p = plans.from_json(d)
    par = p.parallel()
    assert (par.pipeline.schedule, par.schedule, par.pipeline.stage_layers,
            par.pipeline.remat_ratios) == ("gpipe_spmd", "collective_matmul", None, None)
    full = c.stage_plan.remat[0] > 0
    assert p.run_model(cfg).remat == ("full" if full else "none")
    # Megatron-only searches and layouts where the tick executor's strategy wins never get it.
    assert not search_3d(CFG, hw("h100-64"), global_batch=128, seq_len=1024,
                         pipelines=("gpipe_spmd",), baseline=False)


def test_1f1b_spmd_priced_by_hand_and_planned():
    """1f1b_spmd (rings inside 1F1B's stages, no per-stage control flow) is offered where
    gpipe_spmd is; its step by hand: S-1 forward ticks, M ticks of a forward and a backward
    that recomputes the stage, S-1 backward ticks, a permute each way per tick that moves
    something, then M heads (each 1/S of the vocabulary, two all-reduces of one micro-batch's
    output), and the weight passes of its ticks with a backward; its memory holds one
    micro-batch's residuals, below gpipe_spmd's M+S-1. Its plan runs --pipeline 1f1b_spmd."""
    cfg, h, cands = _ring_plans("1f1b_spmd")
    for c in cands:
        sp, lay = c.stage_plan, c.layout
        S, M, n = len(sp.layers), sp.microbatches, sp.layers[0]
        x = stage_inputs(cfg, lay, h, c.strategy, pools=False)
        k = sp.remat[0]
        f = n * x.f[0]
        b = f + n * x.b[0] + k * x.r[0]
        p = c.p2p_s
        outs = lay.rows * 1024 * cfg.d_model * 4 / lay.tensor
        span = lay.replicas * lay.tensor
        head = M * (head_cost(cfg, lay, h)[0] / S
                    + 2 * h.comm_s("all-reduce", outs, [s * span for s in range(S)]))
        # Per tick with a backward: the float32 accumulation and two weight transposes.
        P = cfg.param_count(embeddings=False) / S / lay.tensor
        passes = (M + S - 1) * (h.mem_s(12 * P / lay.fsdp) + h.mem_s(4 * elem_bytes(cfg) * P))
        want = (S - 1) * (f + p) + M * (f + b + 2 * p) + (S - 1) * (b + p) + head + passes
        assert sp.makespan == pytest.approx(want)
        assert sp.finish == pytest.approx([want] * S)
        gp = fixed(stage_inputs(cfg, lay, h, c.strategy), schedule="gpipe_spmd",
                   counts=sp.layers, remat=sp.remat, microbatches=M)
        assert max(sp.memory) < max(gp.memory)
    d = plans.pipeline_plan_json(cands[0], model="oases-h4096-l16", cfg=cfg,
                                 cluster="3090-pcie-32", cost_source="model", search_s=0.0)
    par = plans.from_json(d).parallel()
    assert (par.pipeline.schedule, par.schedule, par.pipeline.stage_layers) == (
        "1f1b_spmd", "collective_matmul", None)


def test_fsdp_hides_nothing_under_fsdp_tp_or_on_cpu():
    """Under fsdp_tp inside the stages the gathers and the all-reduce sit in series with the
    tensor all-reduces, and CPU collectives are synchronous: the forward pays its gathers
    whole, the backward the all-reduce (and on CPU the gathers again)."""
    from oases_jax.planner.cost.stage_fsdp import fsdp_layer_s
    from oases_jax.planner.cost.step_cost import fsdp_collectives

    cfg = CFG.replace(dtype="bfloat16", n_heads=20)
    kw = {"microbatches": 4, "global_batch": 32, "seq_len": 1024}
    ftp, h = Layout(fsdp=4, tensor=2, **kw), hw("h100:16")
    ag_a, ag_m, ar = fsdp_collectives(cfg, ftp, h, reduce="all-reduce")
    f, b, _ = fsdp_layer_s(cfg, ftp, h, 1.0, 1.0)  # a second of work would hide them all
    assert (f, b) == pytest.approx((ag_a + ag_m, ar))
    cpu = Hardware.of(get_cluster("cpu-8"))
    fs = Layout(fsdp=8, microbatches=2, global_batch=16, seq_len=128)
    ag_a, ag_m, ar = fsdp_collectives(get_preset("small"), fs, cpu, reduce="all-reduce")
    f, b, _ = fsdp_layer_s(get_preset("small"), fs, cpu, 1.0, 1.0)
    assert (f, b) == pytest.approx((ag_a + ag_m, ag_a + ag_m + ar))


def test_search_offers_fsdp_tp_inside_stages_with_gspmd_layers_only():
    """fsdp_tp layouts are searched inside the stages, with megatron or megatron_sp only."""
    from oases_jax.planner.search.pipeline import search_3d

    cfg = CFG.replace(dtype="bfloat16", n_heads=20)
    cands = search_3d(cfg, hw("h100:16"), global_batch=32, seq_len=1024, refine=40)
    ftp = [c for c in cands if c.layout.fsdp > 1 and c.layout.tensor > 1]
    assert ftp and {c.rules() for c in ftp} == {"fsdp_tp"}
    assert {c.strategy.schedule for c in ftp} <= {"megatron", "megatron_sp"}


def test_1f1b_spmd_prices_its_weight_passes_by_hand():
    """Each of 1f1b_spmd's M + S - 1 ticks with a backward adds the stage's gradients into the
    float32 accumulator (3 x 4 B a local parameter) and transposes its weights twice (2 x 2 e B);
    gpipe_spmd has none."""
    from oases_jax.planner.search.spmd_stages import spmd_weight_pass_s

    cfg, h = CFG.replace(dtype="bfloat16"), hw("h100:16")
    lay = Layout(data=8, microbatches=4, global_batch=32, seq_len=1024)
    P = cfg.param_count(embeddings=False) / 2
    tick = h.mem_s(12 * P) + h.mem_s(4 * 2 * P)
    assert spmd_weight_pass_s(cfg, lay, h, 2) == pytest.approx(tick)
    x = stage_inputs(cfg, lay, h, LayerSpec(schedule="megatron"), pools=False)
    span = {(sch, w): spmd_fixed(x, [24, 24], [0, 0], 4, 0.0, float("inf"), 0.0, sch, w).makespan
            for sch in ("1f1b_spmd", "gpipe_spmd") for w in (0.0, tick)}
    assert span[("1f1b_spmd", tick)] - span[("1f1b_spmd", 0.0)] == pytest.approx(5 * tick)
    assert span[("gpipe_spmd", tick)] == span[("gpipe_spmd", 0.0)]


def test_residual_passes_follow_the_tensor_degree():
    """A stage's forward stores what each layer keeps at the passes fitted to the compiled
    branches of its tensor degree (4.85 / 3.4 without tensor, 4.3 / 3.3 at 2, 3.65 / 2.55 from
    4), its backward loads it; a rematted layer stores its input alone, and its backward is the
    layer model's rematted one (r the difference)."""
    from oases_jax.planner.cost.layer_cost import LayerModel

    h = hw("h100-8")
    for t, (st, ld) in ((1, (4.85, 3.4)), (2, (4.3, 3.3)), (4, (3.65, 2.55)), (8, (3.65, 2.55))):
        assert residual_passes(t) == (st, ld)
        lay = Layout(data=8 // t, tensor=t, microbatches=4, global_batch=32, seq_len=1024)
        spec = LayerSpec(schedule="megatron")
        x = stage_inputs(CFG, lay, h, spec)
        lm = LayerModel(CFG, lay, h)
        c0, c1 = lm.time(spec), lm.time(dataclasses.replace(spec, remat="full"))
        assert x.f[0] == pytest.approx(c0.fwd_s + h.mem_s(st * c0.act_bytes))
        assert x.b[0] == pytest.approx(c0.bwd_s + h.mem_s(ld * c0.act_bytes))
        assert x.store_save[0] == pytest.approx(h.mem_s(st * c0.act_bytes)
                                                - h.mem_s(st * c1.act_bytes))
        assert x.r[0] == pytest.approx(c1.bwd_s - c0.bwd_s) and x.r[0] > 0
