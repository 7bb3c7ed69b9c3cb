"""The planner: replay and DP by hand arithmetic, cost formulas, the search's errors, plans
end to end."""

import itertools
import json

import numpy as np
import pytest

from oases_jax.errors import UserError
from oases_jax.hardware import collective_time, get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.presets import get_preset
from oases_jax.planner import plan as plans
from oases_jax.planner.cost.layer_cost import LayerModel
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import step_cost
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.dense import MEMORY_BUCKETS, chain_dp, layouts, search
from oases_jax.streams import replay
from tests.scriptrun import run_script


def test_replay_hides_comm_behind_the_compute_between_start_and_done():
    # 2 ms compute, start a 3 ms collective, 1 ms compute, wait: 2 + max(1, 3) = 5.
    assert replay([("c", 2), ("start", "a", 3), ("c", 1), ("done", "a")])[0] == 5
    # Comm shorter than the window: fully hidden, 2 + 4.
    assert replay([("c", 2), ("start", "a", 1), ("c", 4), ("done", "a")])[0] == 6
    # Two collectives share the one comm stream: the second starts at 5, ends at 8.
    ops = [("c", 2), ("start", "a", 3), ("start", "b", 3), ("c", 1), ("done", "b")]
    assert replay(ops)[0] == 8
    # Synchronous collectives (CPU): everything adds up.
    assert replay([("c", 2), ("start", "a", 3), ("c", 1), ("done", "a")], overlap=False)[0] == 6


def test_fsdp_chain_by_hand():
    """One layer's FSDP collectives as XLA orders them (`planner.cost.fsdp_chain`), on a device
    where every GEMM call (and cuDNN's attention) takes 3 s, memory passes are free and every
    collective takes 1 s. GPT-2's six matrices q, k, v, o, fc1, fc2 (q, k, v share one 3 s
    column GEMM, 1 s each).
    Forward: gather q (0-1); each next gather starts once the last is done: k 1-2 behind
    q's GEMM (1-2), v 2-3, o 3-4; attention 4-7, o 7-10 with fc1 gathered 7-8, fc1's GEMM 10-13;
    fc2 gathered only before its use, 13-14, its GEMM 14-17: 17 s for 15 of compute, 2 exposed.
    Backward: the input gradients first, fc2 gathered 0-1, its dX 1-4, fc1's 4-7, o's 7-10 and
    attention's 10-13, v, k, q 13-16, each gathered in time; then the weight gradients, each
    followed by its reduce-scatter (one in flight): fc2 16-19 (its scatter 19-20), fc1 19-22,
    o 22-25, v, k, q 25-28, the last scatter 28-29: 29 s for 27 of compute, 2 exposed.
    Without the gathers and scatters the same compute takes 27 s."""
    from types import SimpleNamespace

    from oases_jax.planner.cost.fsdp_chain import layer_exposed

    hw = SimpleNamespace(
        gemm_s=lambda flops, nbytes, dtype, chunks=1: 3.0, mem_s=lambda nbytes: 0.0,
        comm_s=lambda kind, nbytes, group: 1.0,
        cluster=SimpleNamespace(device_spec=SimpleNamespace(fused_attention=True)))
    cfg = get_preset("gpt2-1.5b").with_overrides(["dtype=bfloat16", "n_layers=4"])
    layout = Layout(fsdp=8, global_batch=8, seq_len=1024)
    fwd, bwd, total = layer_exposed(cfg, layout, hw, LayerSpec(schedule="megatron"))
    assert (fwd, bwd, total) == pytest.approx((2.0, 2.0, 18.0))


def test_replica_reduce_by_hand():
    """The gradients' all-reduce over replicas (`step_cost.replica_reduce_s`) with every
    collective 1 s, 4 layers. Without micro-batches each layer's reduction runs in the backward
    loop: behind the tensor collectives (tensor > 1) 3 of them wait, 1 s each, then the last
    layer's and the rest (embedding, vectors) after the loop, waited for: 5 s of 5. Data
    parallel alone (tensor = 1) each hides behind REPLICA_REDUCE_HIDDEN (0.28) of its layer's
    0.5 s backward: 3 x 0.86 + 2 = 4.58 s. Accumulated over micro-batches: one all-reduce after
    the loop, 1 s, waited for. With every collective priced by its bytes, the rest after the
    loop counts a tied table twice (GPT-2's: one all-reduce per use), an untied one once."""
    from types import SimpleNamespace

    from oases_jax.planner.cost.layer_cost import LayerCost
    from oases_jax.planner.cost.step_cost import replica_reduce_s

    hw = SimpleNamespace(comm_s=lambda kind, nbytes, group: 1.0, async_collectives=True)
    cfg = get_preset("gpt2-1.5b").with_overrides(["n_layers=4"])
    spec = LayerSpec(schedule="megatron")
    costs = {spec: LayerCost(fwd_s=0.25, bwd_s=0.5, compute_s=0.75, comm_s=0.0, act_bytes=0,
                             temp_bytes=0)}
    kw = {"global_batch": 8, "seq_len": 1024}
    local = cfg.param_count()

    def reduce(layout):
        return replica_reduce_s(cfg, layout, hw, [spec] * 4, costs, local / layout.tensor)

    assert reduce(Layout(data=2, tensor=4, **kw)) == pytest.approx((5.0, 5.0))
    assert reduce(Layout(data=8, **kw)) == pytest.approx((4.58, 5.0))
    assert reduce(Layout(data=8, microbatches=2, **kw)) == pytest.approx((1.0, 1.0))
    by_bytes = SimpleNamespace(comm_s=lambda kind, nbytes, group: nbytes, async_collectives=True)
    for tie in (True, False):  # fp32: the layers' matrices and the rest all 4 bytes an element
        c = cfg.replace(tie_embeddings=tie)
        params = c.param_count()
        _, total = replica_reduce_s(c, Layout(data=8, **kw), by_bytes, [spec] * 4, costs, params)
        table = 4 * c.padded_vocab * c.d_model
        assert total == pytest.approx(4 * params + (table if tie else 0.0))


def test_fsdp_embedding_and_clip_by_hand():
    """FSDP's collectives outside the layer loops (`step_cost.embedding_fsdp_s`,
    `clip_norm_s`) with each collective priced at its bytes. Untied (Llama): the head's weight
    gathered in the compute dtype, waited for; its f32 reduce-scatter hidden. Tied (GPT-2):
    the same gather, the table's reduce-scatter and the lookup's f32 gradient gathered over the
    fsdp group, all waited for. The clip: one 4-byte all-reduce per array with a D axis."""
    from types import SimpleNamespace

    from oases_jax.planner.cost.step_cost import clip_norm_s, embedding_fsdp_s

    hw = SimpleNamespace(comm_s=lambda kind, nbytes, group: nbytes, async_collectives=True)
    layout = Layout(fsdp=4, tensor=2, global_batch=8, seq_len=1024)  # 2 rows a replica
    llama = get_preset("llama2-7b").with_overrides(["dtype=bfloat16"])
    table = 32000 * 4096 / 2
    assert embedding_fsdp_s(llama, layout, hw) == pytest.approx((2 * table, 6 * table))
    gpt2 = get_preset("gpt2-1.5b")  # fp32, tied, vocab padded to 50304
    table = 50304 * 1600 / 2
    waited = 4 * table + 4 * table + 4 * 4 * 2 * 1024 * 1600
    assert embedding_fsdp_s(gpt2, layout, hw) == pytest.approx((waited, waited))
    # Llama: 2 norms + 4 attention + 3 MLP matrices a block, embedding, final norm, head: 12;
    # GPT-2: 4 norm arrays + 4 matrices + 2 MLP + 2 biases, embedding, 2 final norm, positions.
    assert clip_norm_s(llama, layout, hw) == pytest.approx(12 * 4)
    assert clip_norm_s(gpt2, layout, hw) == pytest.approx(16 * 4)


def _brute(times, mems, edges, n, budget):
    best = None
    for chain in itertools.product(range(len(times)), repeat=n):
        if sum(mems[list(chain)]) > budget:
            continue
        pairs = zip(chain, chain[1:], strict=False)
        t = sum(times[list(chain)]) + sum(edges[a, b] for a, b in pairs)
        best = t if best is None or t < best else best
    return best


def test_chain_dp_matches_brute_force_under_a_budget():
    rng = np.random.default_rng(0)
    times = np.array([1.0, 2.0, 3.5])
    edges = rng.uniform(0, 0.5, (3, 3))
    # Memories that are whole buckets: the DP is exact.
    buckets = np.array([96.0, 64.0, 32.0])  # four layers need 128..384 of the 256 buckets
    for budget in (3.0, 7.0, 9.0, 12.0):
        mems = buckets * budget / MEMORY_BUCKETS
        got = chain_dp(times, mems, edges, 4, budget)
        best = _brute(times, mems, edges, 4, budget)
        assert (got is None) == (best is None)
        if best is not None:
            assert got[0] == pytest.approx(best)
    # Arbitrary memories: the chain always fits, and is at least as good as the best chain
    # under a budget smaller by one bucket per layer.
    mems = np.array([4.0, 2.0, 1.0])
    for budget in (3.0, 7.0, 9.5, 12.0, 16.0):
        got = chain_dp(times, mems, edges, 4, budget)
        lower = _brute(times, mems, edges, 4, budget - 4 * budget / MEMORY_BUCKETS)
        if got is not None:
            assert sum(mems[got[1]]) <= budget
        if lower is not None:
            assert got is not None and got[0] <= lower + 1e-9


def test_megatron_layer_collectives_by_hand():
    """Megatron, no remat: 2 all-reduces of T*D*e bytes forward and 2 backward per layer."""
    cfg = get_preset("gpt2-1.5b").replace(n_heads=32, head_dim=50)
    hw = Hardware.of(get_cluster("h100:8"))
    lay = Layout(tensor=8, global_batch=8, seq_len=1024)
    lm = LayerModel(cfg, lay, hw)
    cost = lm.time(LayerSpec(schedule="megatron"))
    link = get_cluster("h100:8").levels[0][1]
    one = collective_time("all-reduce", 8 * 1024 * 1600 * 4, 8, link)
    assert cost.comm_s == pytest.approx(4 * one)
    # The forward all-reduces are exposed: forward time = forward compute + 2 all-reduces.
    fwd_ops = lm.layer_ops(LayerSpec(schedule="megatron"))["fwd"]
    compute = sum(op[1] for op in fwd_ops if op[0] == "c")
    assert cost.fwd_s == pytest.approx(compute + 2 * one)


def test_oases_hides_more_than_megatron_and_remat_trades_memory():
    cfg = get_preset("oases-h4096-l16")
    hw = Hardware.of(get_cluster("h100-8"))
    lay = Layout(tensor=8, global_batch=8, seq_len=1024)
    lm = LayerModel(cfg, lay, hw)
    meg = lm.time(LayerSpec(schedule="megatron"))
    oas = lm.time(LayerSpec(schedule="oases", sub_batches=2))
    assert oas.step_s - oas.compute_s < meg.step_s - meg.compute_s
    full = lm.time(LayerSpec(schedule="megatron", remat="full"))
    assert full.act_bytes < meg.act_bytes and full.step_s > meg.step_s
    # On CPU nothing overlaps: the layer takes compute + all communication.
    cpu = LayerModel(cfg, lay, Hardware.of(get_cluster("cpu-8"))).time(
        LayerSpec(schedule="oases", sub_batches=2))
    assert cpu.step_s == pytest.approx(cpu.compute_s + cpu.comm_s)


def test_flash_attention_is_the_causal_kernel_by_hand():
    """On a GPU, bf16 attention under `auto` is cuDNN's causal fused kernel: the forward costs
    the roofline of half of 4 T L H K / t FLOPs (the tiles above the diagonal skipped) with
    only Q, K, V and O (and f32 statistics T H / t) through HBM, the backward 2.5 times those
    FLOPs; the saved activations lose the scores (T L H / t at e bytes plus an f32 copy)
    for the statistics; CPUs and fp32 keep the scores."""
    cfg = get_preset("oases-h4096-l16").replace(dtype="bfloat16")
    hw = Hardware.of(get_cluster("h100-8"))
    dev = hw.cluster.device_spec
    lay = Layout(tensor=8, global_batch=8, seq_len=1024)
    flash, xla = LayerModel(cfg, lay, hw), LayerModel(cfg.replace(attention="xla"), lay, hw)
    assert flash.flash and not xla.flash
    t, tok, h, g, k, e = 8, 8 * 1024, cfg.n_heads, cfg.kv_heads, cfg.k_dim, 2
    scores = tok * 1024 * h / t
    meg = LayerSpec(schedule="megatron")
    attn = flash.sublayers(8, meg)["attn"]
    flops, qkvo = 4 * tok * 1024 * h * k / t / 2, e * tok * (2 * h + 2 * g) * k / t
    stats = 4 * tok * h / t
    assert attn.core == pytest.approx(max(flops / dev.peak("bfloat16"),
                                          (qkvo + stats) / dev.hbm_bytes_per_s))
    assert attn.core_bwd == pytest.approx(max(2.5 * flops / dev.peak("bfloat16"),
                                              (2 * qkvo + stats) / dev.hbm_bytes_per_s))
    assert xla.sublayers(8, meg)["attn"].core_bwd == 2 * xla.sublayers(8, meg)["attn"].core
    saved = xla.saved_bytes(meg) - flash.saved_bytes(meg)
    assert saved == pytest.approx(scores * e + 4 * scores - 4 * tok * h / t)
    assert not LayerModel(cfg, lay, Hardware.of(get_cluster("cpu-8"))).flash
    assert not LayerModel(cfg, lay, Hardware.of(get_cluster("v100-32"))).flash  # sm70
    assert not LayerModel(cfg.replace(dtype="float32"), lay, hw).flash


def test_cluster_json_round_trip_and_own_device(tmp_path):
    """A saved cluster loads back equal; a file may describe a device that is not built in."""
    from oases_jax.hardware import DEVICES, ClusterSpec

    c = get_cluster("3090-nvlink-32")
    assert ClusterSpec.from_json(json.loads(json.dumps(c.to_json()))) == c
    data = get_cluster("h100-8").to_json()
    data["device_spec"].update(name="x9-test", match=["X9"], hbm_bytes_per_s=5e12)
    data.update(name="x9-8", device="x9-test")
    out = tmp_path / "x9.json"
    out.write_text(json.dumps(data))
    try:
        x9 = get_cluster(str(out))
        assert x9.device_spec.hbm_bytes_per_s == 5e12 and x9.device_spec.match == ("X9",)
        step = step_cost(get_preset("small"), Layout(tensor=8, global_batch=8, seq_len=128),
                         [LayerSpec()] * 4, Hardware.of(x9)).step_s
        assert step > 0
    finally:
        DEVICES.pop("x9-test", None)
    data["device_spec"].update(name="h100")
    data["device"] = "h100"
    out.write_text(json.dumps(data))
    with pytest.raises(UserError, match="built in with other numbers"):
        get_cluster(str(out))


def test_update_passes_by_hand():
    """The once-per-step passes (`update_s`): AdamW's 28 B per parameter; in bf16 the weight
    matrices add their cast (4 + 2 B), read their gradient in 2 B instead of 4 and the clip
    reads it once more (2 B): 28 P + 6 P_mat."""
    from oases_jax.planner.cost.step_cost import matrix_share, update_s

    hw = Hardware.of(get_cluster("h100:1"))
    bw = hw.cluster.device_spec.hbm_bytes_per_s
    cfg = get_preset("gpt2-1.5b")
    d, f, n = cfg.d_model, cfg.ff_dim, cfg.n_layers
    p_mat = n * (4 * d * d + 2 * d * f)  # q, k, v, o and the two MLP matrices
    assert matrix_share(cfg) == pytest.approx(p_mat / cfg.param_count())
    p = cfg.param_count()
    assert update_s(cfg, p, hw) == pytest.approx(28 * p / bw)
    bf16 = cfg.replace(dtype="bfloat16")
    assert update_s(bf16, p, hw) == pytest.approx((28 * p + 6 * p_mat) / bw)


def test_static_memory_by_hand():
    cfg = get_preset("gpt2-1.5b").replace(n_heads=32, head_dim=50)
    lay = Layout(data=2, tensor=4, global_batch=8, seq_len=1024)
    c = step_cost(cfg, lay, [LayerSpec()] * cfg.n_layers, Hardware.of(get_cluster("h100:8")))
    assert c.memory["params"] == pytest.approx(4 * cfg.param_count() / 4)
    assert c.memory["optimizer"] == pytest.approx(2 * c.memory["params"])


def test_layouts_respect_divisibility():
    cfg = get_preset("gpt2-1.5b")  # 25 heads: only tensor=1 divides them on 8 devices
    assert {lay.tensor for lay in layouts(cfg, 8, 16, 1024)} == {1}
    got = layouts(get_preset("small"), 8, 16, 128)
    assert all(lay.n_devices == 8 and 16 % (lay.replicas * lay.microbatches) == 0 for lay in got)
    assert {lay.tensor for lay in got} == {1, 2, 4, 8}


def test_search_reports_what_would_fit():
    with pytest.raises(UserError, match="no plan fits .* use more devices"):
        search(get_preset("opt-175b"), Hardware.of(get_cluster("h100-8")), global_batch=8,
               seq_len=2048)


@pytest.mark.parametrize("host_gib", [24, 256])
def test_cpu_devices_share_the_host_memory(monkeypatch, host_gib):
    """A CPU cluster's devices are one host's: each may use 0.9 x host / n. GPT-2 1.5B at
    16 x 128 on 8 of them needs about 3.1 GiB per device at the leanest: refused on a 24 GiB
    host (2.6 GiB each), planned within 0.9 x 32 GiB on a 256 GiB one."""
    import dataclasses

    from oases_jax import hardware

    cpu = dataclasses.replace(hardware.DEVICES["cpu"], memory_bytes=host_gib * 2**30)
    monkeypatch.setitem(hardware.DEVICES, "cpu", cpu)
    cluster = get_cluster("cpu-8")
    assert cluster.memory_per_device == host_gib * 2**30 / 8
    assert get_cluster("h100-8").memory_per_device == hardware.DEVICES["h100"].memory_bytes
    hw = Hardware.of(cluster)
    assert hw.memory_budget() == pytest.approx(0.9 * host_gib * 2**30 / 8)
    cfg = get_preset("gpt2-1.5b")
    if host_gib == 24:
        with pytest.raises(UserError, match="the 8 CPU devices sharing this host's 24.0 GiB"):
            search(cfg, hw, global_batch=16, seq_len=128)
    else:
        r = search(cfg, hw, global_batch=16, seq_len=128)
        assert r.best.cost.peak_memory_bytes <= 0.9 * 32 * 2**30


def test_search_prefers_overlap_on_a_bandwidth_bound_cluster():
    cfg = get_preset("oases-h4096-l16")
    r = search(cfg, Hardware.of(get_cluster("3090-nvlink-32")), global_batch=64, seq_len=1024)
    assert r.best.cost.step_s <= r.baselines["megatron"].cost.step_s
    assert r.best.cost.peak_memory_bytes <= r.budget_bytes
    assert any(s.schedule != "megatron" for s in r.best.strategies)


def test_memory_pressure_mixes_strategies():
    """A budget between the all-`none` and all-`full` remat footprints makes the DP remat only
    some layers; the chain fits and beats every uniform plan that fits."""
    cfg = get_preset("oases-h4096-l16")
    hw = Hardware.of(get_cluster("h100-8"))
    r0 = search(cfg, hw, global_batch=16, seq_len=1024, schedules=("megatron",))
    lay = r0.best.layout
    remats = {s.remat for s in r0.best.strategies}
    lean = step_cost(cfg, lay, [LayerSpec(remat="full")] * cfg.n_layers, hw).peak_memory_bytes
    budget = (r0.best.cost.peak_memory_bytes + lean) / 2
    r = search(cfg, hw, global_batch=16, seq_len=1024, schedules=("megatron",),
               memory_fraction=budget / hw.cluster.device_spec.memory_bytes)
    assert r.best.cost.peak_memory_bytes <= r.budget_bytes
    assert r.best.cost.step_s >= r0.best.cost.step_s
    if r.best.layout == lay:  # the same layout under less memory: fewer layers keep more
        assert len({s.remat for s in r.best.strategies}) > 1 or remats != {
            s.remat for s in r.best.strategies}


def test_plan_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        plans.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        plans.load(bad)
    bad.write_text(json.dumps({"mesh": {"data": 8}}))
    with pytest.raises(UserError, match="not a plan"):
        plans.load(bad)
    bad.write_text(json.dumps({"mesh": {"data": 8}, "microbatches": 1, "global_batch": 8,
                               "seq_len": 32, "layers": [{"schedule": "warp"}]}))
    with pytest.raises(UserError, match="unknown schedule 'warp'"):
        plans.load(bad)


@pytest.mark.parametrize("args,message", [
    (["--model", "nope"], "unknown model preset 'nope'"),
    (["--cluster", "tpu-9"], "unknown cluster 'tpu-9'"),
    (["--model", "opt-175b", "--cluster", "h100-8", "--global-batch", "8"], "no plan fits"),
    (["--cost-source", "magic"], "unknown --cost-source 'magic'"),
])
def test_plan_script_errors(args, message):
    r = run_script("plan.py", *args, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.slow
def test_mixed_plan_trains_like_megatron():
    """A plan with a different strategy on each layer gives the losses of plain megatron."""
    from oases_jax.training import ParallelConfig, TrainConfig, train

    def losses(parallel):
        cfg = TrainConfig(model=get_preset("tiny"), parallel=parallel, steps=6, batch_size=8,
                          seq_len=32, log_every=6, eval_batches=0, progress=False)
        return train(cfg).losses

    ref = losses(ParallelConfig(mesh="data=2,tensor=4"))
    mixed = (LayerSpec(schedule="oases", sub_batches=2, remat="save_proj"),
             LayerSpec(schedule="collective_matmul", remat="full"))
    got = losses(ParallelConfig(mesh="data=2,tensor=4", layers=mixed))
    np.testing.assert_allclose([got[s] for s in ref], list(ref.values()), rtol=1e-4)


@pytest.mark.slow
def test_plan_then_train_end_to_end(tmp_path):
    plan = tmp_path / "plan.json"
    r = run_script("plan.py", "--model", "tiny", "--cluster", "cpu-8", "--global-batch", "8",
                   "--seq-len", "32", "--explain", "--json", str(plan), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "<- chosen" in r.stdout
    d = json.loads(plan.read_text())
    for key in ("mesh", "layers", "predicted_step_s", "predicted_peak_memory_bytes",
                "baselines", "search_s"):
        assert key in d
    assert "megatron" in d["baselines"] and "best_uniform" in d["baselines"]
    r = run_script("train.py", "--model", "tiny", "--plan", str(plan), "--steps", "3",
                   "--out-dir", str(tmp_path / "run"), "--no-progress", "--eval-batches", "0",
                   timeout=300)
    assert r.returncode == 0, r.stderr
    assert "loss" in r.stdout
    r = run_script("train.py", "--model", "tiny", "--plan", "auto", "--batch-size", "8",
                   "--seq-len", "32", "--steps", "2", "--out-dir", str(tmp_path / "auto"),
                   "--no-progress", "--eval-batches", "0", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "plan auto" in r.stdout


@pytest.mark.parametrize("name, per_node, n", [("v100-64", 4, 64), ("h100-64", 8, 64)])
def test_merak_clusters(name, per_node, n):
    """Merak's 64 GPUs: a group inside a node uses its fast link, one across nodes the slow one."""
    c = get_cluster(name)
    assert c.n_devices == n and c.levels[0][0] == per_node
    inside, across = c.link_for(list(range(per_node))), c.link_for([0, per_node])
    assert inside.bytes_per_s > 2 * across.bytes_per_s


def test_fsdp_overlapped_layers_keep_their_gathered_weights():
    """Under fsdp an oases layer without remat keeps the weights it gathered inside its
    shard_map until its backward (e bytes x its weight matrices / t: hand arithmetic for
    oases-h4096-l16, fp32, t=4: 12 x 4096^2 x 4 B / 4 a layer); megatron (GSPMD), a rematted
    layer, and a replicated layout keep none, and the step's peak carries the difference."""
    cfg = get_preset("oases-h4096-l16")
    hw = Hardware.of(get_cluster("3090-pcie-32"))
    fsdp = Layout(fsdp=8, tensor=4, global_batch=32, seq_len=1024)
    per_layer = 12 * 4096**2 * 4 / 4
    oases = LayerSpec(schedule="oases", sub_batches=2)
    none, proj = oases, LayerSpec(schedule="oases", sub_batches=2, remat="save_proj")
    from oases_jax.planner.cost.step_cost import gathered_layer_bytes
    assert gathered_layer_bytes(cfg, fsdp, none) == per_layer
    assert gathered_layer_bytes(cfg, fsdp, proj) == 0
    assert gathered_layer_bytes(cfg, fsdp, LayerSpec(schedule="megatron")) == 0
    replicated = Layout(data=8, tensor=4, global_batch=32, seq_len=1024)
    assert gathered_layer_bytes(cfg, replicated, none) == 0
    cost = step_cost(cfg, fsdp, [none] * cfg.n_layers, hw)
    assert cost.memory["gathered_weights"] == cfg.n_layers * per_layer
    assert "gathered_weights" not in step_cost(cfg, fsdp, [proj] * cfg.n_layers, hw).memory


def test_oases_sp_ops_by_hand():
    """oases_sp (`seq_deferred`) on 2 sub-batches: per sub-layer and sub-batch one all-gather and
    one reduce-scatter of half the stream each way (megatron_sp's bytes, twice as many
    collectives); forward, a sub-layer's gathers are issued together and each step's
    reduce-scatter is waited for only before the next step's row GEMM; backward, the MLP steps'
    dY gathers are issued at once and each attention step's once its sub-batch's MLP norm
    backward is done, and every dX reduce-scatter is covered by its own dW GEMM. The same
    compute as megatron_sp, less of the communication exposed."""
    cfg = get_preset("gpt2-1.5b").replace(dtype="bfloat16", n_heads=32, head_dim=50)
    hw = Hardware.of(get_cluster("h100:8"))
    lm = LayerModel(cfg, Layout(tensor=8, global_batch=8, seq_len=1024), hw)
    ops = lm.layer_ops(LayerSpec(schedule="oases_sp", sub_batches=2))
    starts = [op[1] for op in ops["fwd"] if op[0] == "start"]
    assert starts == ["attn0g", "attn1g", "attn0", "attn1", "mlp0g", "mlp1g", "mlp0", "mlp1"]
    fwd = [op for op in ops["fwd"] if op[0] != "c"]
    # attn1 waits for its own gather, then for attn0's reduce-scatter before its row GEMM;
    # the MLP's norms wait for the attention's last reduce-scatter.
    i = fwd.index(("done", "attn1g"))
    assert fwd[i + 1] == ("done", "attn0") and fwd[i + 2][:2] == ("start", "attn1")
    keys = [op[:2] for op in fwd]
    assert keys[keys.index(("start", "mlp0g")) - 1] == ("done", "attn1")
    bwd = [op[:2] for op in ops["bwd"] if op[0] != "c"]
    assert bwd[:2] == [("start", "gmlp1"), ("start", "gmlp0")]
    assert bwd.index(("start", "gattn1")) == bwd.index(("done", "bmlp1")) + 1
    assert bwd.index(("start", "gattn0")) == bwd.index(("done", "bmlp0")) + 1
    half = 8 * 1024 * 1600 * 2 / 2
    link = get_cluster("h100:8").levels[0][1]
    one = collective_time("all-gather", half, 8, link) + collective_time(
        "reduce-scatter", half, 8, link)
    osp = lm.time(LayerSpec(schedule="oases_sp", sub_batches=2))
    assert osp.comm_s == pytest.approx(2 * 2 * 2 * one)  # fwd + bwd, 2 sub-layers, 2 halves
    sp = lm.time(LayerSpec(schedule="megatron_sp"))
    # One more schedule pass over the stream; half-batch GEMMs read their weights twice.
    passes = hw.mem_s(8 * 1024 * 1600 * 2)
    assert sp.compute_s + passes < osp.compute_s < (sp.compute_s + passes) * 1.001
    assert osp.step_s - osp.compute_s < sp.step_s - sp.compute_s
