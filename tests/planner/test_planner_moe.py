"""The MoE planner: layouts and groups, the MoE step's formulas by hand arithmetic, the expert
degree the search picks and why, MoE plans read back (schema, parallel config, remat), and the
one-line errors."""

import math

import pytest

from oases_jax.errors import UserError
from oases_jax.hardware import collective_time, get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.presets import get_preset
from oases_jax.moe import cost as cost
from oases_jax.planner import make_plan
from oases_jax.planner import plan as plans
from oases_jax.planner.cost.moe_step import (
    MoEChoice,
    grad_reduce_s,
    moe_choices,
    moe_ffn_cost,
    moe_shape,
    moe_static_memory,
)
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout, data_group, expert_group, replica_group
from oases_jax.planner.search.dense import SCHEDULES, search
from oases_jax.planner.search.moe import moe_layouts, search_moe
from tests.scriptrun import run_script

BF16 = {"dtype": "bfloat16"}


def _hw(name):
    return Hardware.of(get_cluster(name))


def _search(model, cluster, batch, seq, **kw):
    cfg = get_preset(model).replace(**BF16)
    return search_moe(cfg, _hw(cluster), global_batch=batch, seq_len=seq, **kw)


def test_layout_orders_data_and_expert_and_their_groups():
    inner = Layout(data=2, expert=4, tensor=2, global_batch=16, seq_len=128)
    assert list(inner.mesh().items()) == [("data", 2), ("expert", 4), ("tensor", 2)]
    assert inner.rows == 2 and inner.replicas == 8 and inner.rules() == "tp"
    assert expert_group(inner) == [0, 2, 4, 6] and data_group(inner) == [0, 8]
    outer = Layout(data=2, expert=4, tensor=2, expert_inner=False, global_batch=16, seq_len=128)
    assert list(outer.mesh().items()) == [("expert", 4), ("data", 2), ("tensor", 2)]
    assert expert_group(outer) == [0, 4, 8, 12] and data_group(outer) == [0, 2]
    assert replica_group(inner) == replica_group(outer) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert Layout(expert=8, global_batch=8, seq_len=8).label() == "expert=8"


def test_layouts_keep_expert_degrees_that_divide_the_experts():
    cfg = get_preset("small-moe")  # 8 experts, 8 heads
    got = moe_layouts(cfg, 8, 16, 128, max_microbatches=1)
    assert {(x.data, x.expert, x.tensor) for x in got} == {
        (d, e, t) for t in (1, 2, 4, 8) for e in (1, 2, 4, 8) if t * e <= 8
        for d in [8 // (t * e)] if d * t * e == 8}
    assert {x.expert for x in moe_layouts(cfg, 8, 16, 128, expert_degrees=(2,))} == {2}
    # Both orders only where data and expert both exceed 1.
    both = {(x.data, x.expert) for x in got if x.data > 1 and x.expert > 1}
    assert {(x.data, x.expert) for x in got if not x.expert_inner} == both


def test_static_memory_splits_experts_over_expert_and_tensor():
    cfg = get_preset("small-moe")  # gpt2: biases, 2 MoE layers of 8 experts, D 256, F 1024
    layout = Layout(data=2, expert=2, tensor=2, microbatches=2, global_batch=16, seq_len=128)
    d, f, e = 256, 1024, 8
    mats = 2 * e * (2 * d * f + f)  # w_in, w_out, b_in of both MoE layers
    b_out = 2 * e * d
    local = (cfg.param_count() - mats - b_out) / 2 + mats / 4 + b_out / 2
    mem = moe_static_memory(cfg, layout)
    assert mem["params"] == pytest.approx(4 * local)
    assert mem["optimizer"] == pytest.approx(8 * local)
    assert mem["grad_accumulator"] == pytest.approx(4 * local)
    assert "compute_weights" not in mem  # float32


def test_gradient_reduction_dense_over_replicas_experts_over_data():
    cfg = get_preset("small-moe")
    hw = _hw("h100-32")
    for inner in (True, False):
        lay = Layout(data=4, expert=4, tensor=2, expert_inner=inner, global_batch=32,
                     seq_len=128)
        mem = moe_static_memory(cfg, lay)
        experts = 2 * 8 * (2 * 256 * 1024 + 1024) / 8 + 2 * 8 * 256 / 4
        dense = mem["params"] / 4 - experts
        want = hw.comm_s("all-reduce", 4 * dense, replica_group(lay)) \
            + hw.comm_s("all-reduce", 4 * experts, data_group(lay))
        assert grad_reduce_s(cfg, lay, hw) == pytest.approx(want)
    # The data group crosses nodes (8 GPUs each) only when expert is the inner axis.
    link = hw.cluster.link_for
    assert link(data_group(Layout(data=4, expert=4, tensor=2, global_batch=32, seq_len=8))) \
        != link(data_group(Layout(data=4, expert=4, tensor=2, expert_inner=False,
                                  global_batch=32, seq_len=8)))
    # With an expert axis every micro-batch's gradients are reduced (the runtime's batch is
    # split over data x expert): x2.
    two = Layout(data=4, expert=4, tensor=2, microbatches=2, global_batch=32, seq_len=128)
    one = Layout(data=4, expert=4, tensor=2, global_batch=32, seq_len=128)
    assert grad_reduce_s(cfg, two, hw) == pytest.approx(2 * grad_reduce_s(cfg, one, hw))


def test_moe_feed_forward_drops_or_adds_the_restore_by_the_dense_schedule():
    cfg = get_preset("small-moe")
    hw = _hw("h100-8")
    lay = Layout(data=2, expert=2, tensor=2, global_batch=16, seq_len=128)
    tokens = 16 // 4 * 128
    r = collective_time("all-gather", tokens * 256 * 4, 2, hw.cluster.link_for([0, 1]))
    assert r > 0
    mega, sp = LayerSpec(schedule="megatron"), LayerSpec(schedule="megatron_sp")
    for name, sign in (("parm_s1", -1), ("ds_moe", 1)):
        a = moe_ffn_cost(cfg, lay, hw, MoEChoice(name), mega)
        b = moe_ffn_cost(cfg, lay, hw, MoEChoice(name), sp)
        assert b.fwd_s - a.fwd_s == pytest.approx(sign * r)
        assert b.bwd_s - a.bwd_s == pytest.approx(sign * r)
    # The megatron figures are the alpha-beta model's own; remat adds the forward once more.
    est = cost.estimate(moe_shape(cfg, lay), cost.MoEHardware.of(hw.cluster, [0, 2], [0, 1]),
                        "parm_s1")
    a = moe_ffn_cost(cfg, lay, hw, MoEChoice("parm_s1"), mega)
    assert (a.fwd_s, a.bwd_s) == pytest.approx((est.forward_s, est.backward_s))
    full = moe_ffn_cost(cfg, lay, hw, MoEChoice("parm_s1"), LayerSpec(schedule="megatron",
                                                                       remat="full"))
    assert full.bwd_s == pytest.approx(a.bwd_s + a.fwd_s)
    assert full.act_bytes == 0 and a.act_bytes > 0 and full.temp_bytes > a.temp_bytes


def test_moe_choices_local_without_expert_axis_and_chunks_up_to_the_slots():
    cfg = get_preset("small-moe")
    assert moe_choices(cfg, Layout(data=8, global_batch=16, seq_len=128)) == [MoEChoice("local")]
    lay = Layout(data=2, expert=2, tensor=2, global_batch=16, seq_len=128)
    got = moe_choices(cfg, lay)
    slots = cost.slots(moe_shape(cfg, lay), "parm_s1")
    assert got[0] == MoEChoice("parm_s1") and got[-1] == MoEChoice("ds_moe")
    assert [c.chunks for c in got if c.schedule == "parm_s2"] == [
        r for r in cost.CHUNKS if 1 < r <= slots]
    assert moe_choices(cfg, lay, ("parm_s2",))[0].label() == "parm_s2/2"


def test_many_experts_pick_an_expert_axis_for_the_gradient_reduction():
    # 32 experts of 768 x 3072 in 6 MoE layers, 4 nodes of 8 H100s: replicated experts'
    # gradients (1.4 GB in bf16 x 2 for fp32) cost more to reduce than the all-to-alls.
    r = _search("gpt2-moe-h768-e32", "h100-32", 512, 1024, max_microbatches=1)
    best, none = r.best, r.baselines["no_expert"]
    assert best.layout.expert > 1 and none.layout.expert == 1
    assert best.cost.step_s < none.cost.step_s
    assert none.step.reduce_s - best.step.reduce_s > best.step.moe_comm_s - none.step.moe_comm_s


def test_few_small_experts_and_many_tokens_keep_experts_local():
    # 4 experts of 128 x 512, 64 x 128 tokens per device: the all-to-alls would cost more
    # than the few expert gradients they save reducing.
    r = _search("tiny-moe", "h100-8", 4096, 128)
    best, ep = r.best, r.baselines["expert"]
    assert best.layout.expert == 1 and best.moe == MoEChoice("local") and ep.layout.expert > 1
    assert ep.step.moe_comm_s - best.step.moe_comm_s > best.step.reduce_s - ep.step.reduce_s


def test_expert_inside_or_across_nodes_is_priced_both_ways():
    # Token-heavy small-moe on 4 nodes: the all-to-all inside a node wins ...
    r = _search("small-moe", "h100-32", 4096, 256, expert_degrees=(8,), max_microbatches=1)
    by = {(c.layout.data, c.layout.tensor, c.layout.expert_inner, c.layout.microbatches): c
          for c in r.ranked}
    inner, outer = by[(4, 1, True, 1)], by[(4, 1, False, 1)]
    assert r.best.layout.expert_inner and inner.step.moe_comm_s < outer.step.moe_comm_s
    # ... while for Mixtral's 45B expert parameters (data=2, expert=8, tensor=4 on 8 nodes of
    # 8) data inside a node and the all-to-alls across nodes win: the experts' gradients are
    # all-reduced over NVLink rather than InfiniBand.
    m = _search("mixtral-8x7b", "h100-64", 64, 4096, expert_degrees=(8,), max_microbatches=1)
    by = {(c.layout.data, c.layout.tensor, c.layout.expert_inner, c.layout.microbatches): c
          for c in m.ranked}
    inner, outer = by[(2, 4, True, 1)], by[(2, 4, False, 1)]
    assert outer.cost.step_s < inner.cost.step_s and outer.step.reduce_s < inner.step.reduce_s
    # (8 experts x tensor 4 span nodes either way: the same all-to-alls.)
    assert outer.step.moe_comm_s == pytest.approx(inner.step.moe_comm_s)


def test_make_plan_writes_an_moe_plan_that_runs_as_one_strategy():
    cfg = get_preset("small-moe")
    d, r = make_plan(cfg, model="small-moe", cluster=get_cluster("cpu-8"), global_batch=16,
                     seq_len=128)
    best = r.best
    assert d["moe"]["expert"] == best.layout.expert == d["mesh"].get("expert", 1)
    assert d["moe"]["schedule"] == best.moe.schedule and d["rules"] in ("dp", "tp", "tp_sp")
    assert len({tuple(sorted(x.items())) for x in d["layers"]}) == 1
    plan = plans.from_json(d)
    par = plan.parallel()
    assert par.layers is None and par.schedule == d["layers"][0]["schedule"]
    assert par.moe_schedule == d["moe"]["schedule"]
    full = plans.from_json({**d, "layers": [{**x, "remat": "full"} for x in d["layers"]]})
    assert full.run_model(cfg).remat == "full" and full.compile_spec(cfg).model.remat == "full"
    with pytest.raises(ValueError, match="plans dense models"):
        search(cfg, _hw("cpu-8"), global_batch=16, seq_len=128)


def _moe_plan(**moe):
    layer = {"schedule": "megatron", "sub_batches": 1, "remat": "none"}
    return {"model": "small-moe", "global_batch": 16, "seq_len": 128, "microbatches": 1,
            "mesh": {"data": 2, "expert": 2, "tensor": 2}, "rules": "tp", "layers": [layer] * 4,
            "moe": {"expert": 2, "schedule": "parm_s2", "chunks": 2, **moe}}


@pytest.mark.parametrize("change, message", [
    ({"moe": None}, "has an expert axis but the plan has no moe section"),
    ({"mesh": {"data": 4, "tensor": 2}, "moe": {"expert": 1, "schedule": "parm_s1"}},
     "'local' runs without an expert axis"),
    ({"moe": {"expert": 4, "schedule": "parm_s1"}}, "moe.expert = 4 but the mesh's expert"),
    ({"moe": {"expert": 2, "schedule": "parm_s1", "chunks": 2}}, "only parm_s2 runs in chunks"),
    ({"rules": "fsdp_tp"}, "MoE models run under rules dp, tp or tp_sp"),
    ({"layers": [{"schedule": "megatron", "remat": r} for r in ("none", "full") * 2]},
     "MoE plans run one dense strategy on every layer"),
    ({"layers": [{"schedule": "oases", "sub_batches": 2}] * 4}, "MoE layer groups run under"),
    ({"model": "small"}, "the plan has a moe section but model is a dense model"),
    ({"model": "small-moe", "mesh": {"expert": 8}, "rules": "dp",
      "model_config": {"n_experts": 4, "d_model": 256, "n_layers": 4, "n_heads": 8,
                       "vocab_size": 256, "max_seq_len": 256, "moe_every": 2},
      "moe": {"expert": 8, "schedule": "parm_s1"}}, "does not divide model_config's 4 experts"),
])
def test_moe_plan_mistakes_are_one_line(change, message):
    d = _moe_plan()
    d.update(change)
    if d.get("moe") is None:
        del d["moe"]
    with pytest.raises(UserError, match=message) as e:
        plans.from_json(d, "plan file 'p.json'")
    assert "\n" not in str(e.value)


def test_a_dense_plan_for_an_moe_model_is_refused_and_dense_plans_still_load():
    d = _moe_plan()
    del d["moe"]
    d["mesh"] = {"data": 8}
    d["rules"] = "dp"
    with pytest.raises(UserError, match="planned as a dense model"):
        plans.from_json(d)
    dense = {**d, "model": "small"}
    assert plans.from_json(dense).parallel().layers is not None
    assert plans.from_json(_moe_plan()).parallel().moe_chunks == 2


def test_moe_flag_errors_are_one_line():
    r = run_script("plan.py", "--model", "small-moe", "--expert-degrees", "3", timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "expert degree 3 must divide the model's 8 experts and the 8 devices" in lines[0]
    from oases_jax.scripts import plan as script

    for argv, message in ((["--model", "small", "--expert-degrees", "2"],
                           "--expert-degrees needs an MoE model"),
                          (["--model", "small-moe", "--moe-schedules", "parm_s9"],
                           "unknown MoE schedule 'parm_s9'"),
                          (["--model", "small-moe", "--expert-degrees", "2,x"],
                           "must be positive integers"),
                          (["--model", "small-moe", "--schedules", "oases"],
                           "none runs MoE layer groups")):
        args = script.parse_args(argv)
        with pytest.raises(UserError, match=message):
            script.check_args(args)
            cfg = get_preset(args.model)
            schedules = tuple(args.schedules.split(",")) if args.schedules else SCHEDULES
            script.search_plan(args, cfg, get_cluster("cpu-8"), None, 128, schedules)


def test_the_printed_ranking_says_why_the_expert_degree():
    r = run_script("plan.py", "--model", "tiny-moe", "--model-set", "dtype=bfloat16",
                   "--cluster", "h100-8", "--global-batch", "4096", "--seq-len", "128",
                   "--top", "3", timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "MoE comm" in out and "reduce" in out.splitlines()[1]
    assert "best: data=8" in out and "moe local" in out
    with_ep = next(ln for ln in out.splitlines() if ln.startswith("best with an expert axis"))
    ms = [float(x) for x in with_ep.split("MoE comm ")[1].split(" ms")[0:1]]
    assert ms[0] > 0 and "gradient reduction" in with_ep and "faster" in with_ep
    assert math.isfinite(ms[0])


def test_moe_feed_forward_prices_through_the_planners_hardware_and_its_profile():
    """The MoE feed-forward is priced by the planner's one `Hardware`: with a calibration
    profile its compute alone is every GEMM at the profile's rate and every memory pass at its
    bandwidth, so doubling both halves it exactly (overheads 0), where the datasheet's roofline
    would not move; and its collectives take the profile's fits."""
    from oases_jax.planner.calibration.profile import CommFit, GemmFit, MemFit, Profile

    cfg = get_preset("small-moe")
    cluster = get_cluster("h100-8")
    lay = Layout(data=2, expert=2, tensor=2, global_batch=16, seq_len=128)
    mega = LayerSpec(schedule="megatron")

    def hw_at(rate, comm_s_per_byte=None):
        kinds = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce")
        comm = {} if comm_s_per_byte is None else {
            (k, n): CommFit(bytes_per_s=1 / comm_s_per_byte, latency_s=0.0)
            for k in kinds for n in (2, 4, 8)}
        prof = Profile(source="profile", device="h100", n_devices=8, samples={}, meta={},
                       gemm={dt: GemmFit(flops_per_s=rate, overhead_s=0.0)
                             for dt in ("float32", "bfloat16")},
                       comm=comm, memory=MemFit(bytes_per_s=rate / 100, overhead_s=0.0))
        return Hardware.of(cluster, prof)

    slow = moe_ffn_cost(cfg, lay, hw_at(1e12), MoEChoice("parm_s1"), mega)
    fast = moe_ffn_cost(cfg, lay, hw_at(2e12), MoEChoice("parm_s1"), mega)
    assert fast.compute_s == pytest.approx(slow.compute_s / 2, rel=1e-9)
    sheet = moe_ffn_cost(cfg, lay, Hardware.of(cluster), MoEChoice("parm_s1"), mega)
    assert sheet.compute_s != pytest.approx(slow.compute_s, rel=1e-3)
    # collectives at the profile's 1 ns a byte are far slower than NVLink's datasheet
    costly = moe_ffn_cost(cfg, lay, hw_at(1e12, 1e-9), MoEChoice("parm_s1"), mega)
    assert costly.compute_s == pytest.approx(slow.compute_s)
    assert costly.step_s > slow.step_s + 1e-5
