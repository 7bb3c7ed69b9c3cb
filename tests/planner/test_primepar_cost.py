"""PrimePar's planner costs checked by hand arithmetic on a tiny square (q = 2), the transfer
counts of docs/parallelism.md for q = 4, and what the search and plans do with it."""

import pytest

from oases_jax.errors import UserError
from oases_jax.hardware import ClusterSpec, LinkSpec
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner import plan as plans
from oases_jax.planner.cost.layer_cost import LayerModel
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.primepar_cost import Square
from oases_jax.planner.cost.step_cost import head_cost, head_tensor_comm_s, step_cost
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.dense import layouts, search, strategies
from oases_jax.streams import replay

# D 64, 4 heads of 16, MLP 256, V 128, fp32 (e = 4); 8 rows x 16 tokens: T = 128, q = 2.
CFG = ModelConfig(family="gpt2", d_model=64, n_layers=2, n_heads=4, d_ff=256, vocab_size=128,
                  max_seq_len=16)
LAYOUT = Layout(tensor=4, global_batch=8, seq_len=16, primepar=True)
# The "cpu" datasheet: 20 GFLOP/s, 10 GB/s of memory; links of 1 GB/s and 1 us.
CLUSTER = ClusterSpec(name="square", device="cpu", n_devices=4,
                      levels=((4, LinkSpec(name="l", bytes_per_s=1e9, latency_s=1e-6)),))
US = 1e-6


def square(async_collectives=True, layout=LAYOUT, cfg=CFG) -> Square:
    return Square(LayerModel(cfg, layout, Hardware(CLUSTER, None, async_collectives)))


def test_column_forward_by_hand():
    # QKV: K = 64, N = 192. Step GEMM [64, 32] x [32, 96]: 2*128*64*192/8 FLOPs / 20e9
    # = 19.6608 us (its 45056 bytes take 4.5 us). W block 32*96*4 = 12288 B: 13.288 us;
    # partial Y 64*96*4 = 24576 B: 25.576 us.
    ops = square().column_fwd("qkv", 64, 192)
    # Step 0 hides the W shift behind the GEMM; step 1 waits for the partial sum.
    assert replay(ops)[0] == pytest.approx((19.6608 + 25.576) * US)
    # Synchronous collectives: everything adds up.
    assert replay(ops, overlap=False)[0] == pytest.approx((2 * 19.6608 + 13.288 + 25.576) * US)


def test_row_forward_and_backwards_by_hand():
    sq = square()
    # MLP out: K = 256, N = 64. Step GEMM [64, 128] x [128, 32]: 26.2144 us. X block
    # 64*128*4 = 32768 B: 33.768 us; W block 128*32*4 = 16384 B: 17.384 us.
    # Forward: step 0 moves X and W (one after the other on the link), step 1 moves nothing.
    assert replay(sq.row_fwd("o", 256, 64))[0] == pytest.approx((33.768 + 17.384 + 26.2144) * US)
    # Backward: step 0 dW GEMM while W and X move (51.152); step 1 dX + dW GEMMs (52.4288)
    # while the partial dW moves (17.384); the last dX GEMM while the partial dX moves (33.768).
    assert replay(sq.row_bwd("o", 256, 64))[0] == pytest.approx((51.152 + 52.4288 + 33.768) * US)
    # QKV backward: step 0 dW GEMM (19.6608) while dY (25.576) and W (13.288) move; step 1
    # dX + dW (39.3216) while the partial dW (13.288) moves; the last dX GEMM.
    assert replay(sq.column_bwd("q", 64, 192))[0] == pytest.approx(
        (38.864 + 39.3216 + 19.6608) * US)


def _permutes(ops):
    return [op for op in ops if op[0] == "start"]


def test_transfer_counts_and_bytes_match_docs_for_q4():
    """docs/parallelism.md: per projection q - 1 transfers of each moving block."""
    lay = Layout(data=1, tensor=16, global_batch=16, seq_len=16, primepar=True)
    sq = square(layout=lay)
    assert len(_permutes(sq.column_fwd("c", 64, 192))) == 2 * 3  # W, partial Y
    assert len(_permutes(sq.row_fwd("r", 64, 64))) == 2 * 3  # X, W
    assert len(_permutes(sq.column_bwd("c", 64, 192))) == 3 * 3  # dY, W, partial dW
    assert len(_permutes(sq.row_bwd("r", 64, 64))) == 4 * 3  # X, W, partial dW, partial dX
    # Row backward bytes: (q-1) (M K + K N + K N + M K) e / q^2 with M = 256 tokens.
    link = CLUSTER.levels[0][1]
    secs = sum(op[2] for op in _permutes(sq.row_bwd("r", 64, 64)))
    nbytes = 3 * (256 * 64 + 64 * 64 + 64 * 64 + 256 * 64) * 4 / 16
    assert secs == pytest.approx(nbytes / link.bytes_per_s + 12 * link.latency_s)


def test_layer_collectives_besides_the_rotations():
    ops = square().layer_ops(LayerSpec(schedule="primepar"))
    reduces = [op for op in ops["fwd"] + ops["bwd"] if op[0] == "start" and ".s" in op[1]]
    # LayerNorm: mean and variance forward, two reductions backward, for each of the 2 norms;
    # each an all-reduce over tp_col of T/q fp32 = 256 B: 2*(1/2)*256/1e9 + 2 us.
    assert len(reduces) == 8
    assert all(op[2] == pytest.approx(2.256 * US) for op in reduces)
    # Bias skews: q, k, v and MLP in, forward and backward.
    skews = [op for op in ops["fwd"] + ops["bwd"] if op[0] == "start" and ".b" in op[1]]
    assert len(skews) == 8


def test_memory_by_hand():
    sq = square()
    # none: [4 T D + T (H + 2G) K + T H K + T L H + 2 T F] e / q^2 + 4 T L H / q^2
    #     = (32768 + 24576 + 8192 + 8192 + 65536) * 4 / 4 + 4 * 8192 / 4
    assert sq.saved_bytes(LayerSpec(schedule="primepar")) == 139264 + 8192
    # save_proj: (5 T D + T (H + 2G) K + T F) e / q^2; full: T D e / q^2.
    assert sq.saved_bytes(LayerSpec(schedule="primepar", remat="save_proj")) == 98304
    assert sq.saved_bytes(LayerSpec(schedule="primepar", remat="full")) == 8192
    # Temp: f32 scores and their gradient 8 * 8192 / 4 = 16384; the MLP out backward moves the
    # most: 2 X (32768 B each) + W + partial dW (16384 B each), two of each: 196608.
    assert sq.temp_bytes(LayerSpec(schedule="primepar")) == 16384 + 196608
    # Nothing is replicated: q^2 devices hold what one device holds without parallelism.
    one = LayerModel(CFG, Layout(global_batch=8, seq_len=16), Hardware(CLUSTER))
    for remat in ("none", "full"):
        got = sq.saved_bytes(LayerSpec(schedule="primepar", remat=remat))
        assert 4 * got == one.saved_bytes(LayerSpec(remat=remat))
    # Parameters, gradients and Adam moments split q^2 ways.
    c = step_cost(CFG, LAYOUT, [LayerSpec(schedule="primepar")] * 2, Hardware(CLUSTER))
    assert c.memory["params"] == pytest.approx(4 * CFG.param_count() / 4)


def test_head_collectives_by_hand():
    plain = Layout(tensor=4, global_batch=8, seq_len=16)
    # Hidden state T D e / q = 16384 B and table V D 4 / q = 16384 B; over 2 devices an
    # all-gather costs (1/2) S / B + a = 9.192 us, an all-reduce 2 (1/2) S / B + 2 a = 18.384.
    for sync, extra in ((False, 9.192 + 18.384 + 9.192), (True, 2 * (9.192 + 18.384) + 9.192)):
        hw = Hardware(CLUSTER, None, async_collectives=not sync)
        # The plain layout's own vocabulary-parallel all-reduces are not primepar's.
        plain_s = head_cost(CFG, plain, hw)[0] - head_tensor_comm_s(CFG, plain, hw)
        got = head_cost(CFG, LAYOUT, hw)[0] - plain_s
        assert got == pytest.approx(extra * US)
    assert head_cost(CFG, LAYOUT, Hardware(CLUSTER))[1] \
        == head_cost(CFG, plain, Hardware(CLUSTER))[1] + 2 * 16384


def test_nothing_overlaps_on_cpu():
    cost = LayerModel(CFG, LAYOUT, Hardware.of(CLUSTER)).time(LayerSpec(schedule="primepar"))
    assert cost.step_s == pytest.approx(cost.compute_s + cost.comm_s)
    faster = LayerModel(CFG, LAYOUT, Hardware(CLUSTER)).time(LayerSpec(schedule="primepar"))
    assert faster.step_s < cost.step_s


def test_primepar_only_on_its_layouts():
    with pytest.raises(ValueError, match="primepar layout needs tensor = q"):
        Layout(tensor=8, global_batch=8, seq_len=16, primepar=True)
    with pytest.raises(ValueError, match="runs on primepar layouts"):
        LayerModel(CFG, Layout(tensor=4, global_batch=8, seq_len=16), Hardware(CLUSTER)).time(
            LayerSpec(schedule="primepar"))
    with pytest.raises(ValueError, match="runs on primepar layouts"):
        LayerModel(CFG, LAYOUT, Hardware(CLUSTER)).time(LayerSpec(schedule="megatron"))


def test_search_offers_primepar_layouts_and_plans_round_trip():
    from oases_jax.hardware import get_cluster
    from oases_jax.models.presets import get_preset

    cfg = get_preset("small")
    found = layouts(cfg, 8, 16, 128)
    squares = [lay for lay in found if lay.primepar]
    assert {lay.label() for lay in squares} == {"data=2,tp_row=2,tp_col=2",
                                               "data=2,tp_row=2,tp_col=2 x2mb",
                                               "data=2,tp_row=2,tp_col=2 x4mb"}
    assert all(lay.mesh() == {"data": 2, "tp_row": 2, "tp_col": 2} for lay in squares)
    assert {s.schedule for s in strategies(squares[0])} == {"primepar"}
    assert all(s.schedule != "primepar" for lay in found if not lay.primepar
               for s in strategies(lay))
    # Restricted to primepar, only the square layouts are searched.
    assert all(lay.primepar for lay in layouts(cfg, 8, 16, 128, schedules=("primepar",)))
    hw = Hardware.of(get_cluster("cpu-8"))
    r = search(cfg, hw, global_batch=16, seq_len=128, schedules=("primepar",))
    assert r.best.layout.primepar and {s.schedule for s in r.best.strategies} == {"primepar"}
    d = plans.plan_json(r, model="small", cfg=cfg, cluster="cpu-8", cost_source="datasheet")
    assert d["mesh"] == {"data": 2, "tp_row": 2, "tp_col": 2} and d["rules"] == "primepar"
    p = plans.from_json(d)
    assert p.mesh == "data=2,tp_row=2,tp_col=2" and p.rules == "primepar"
    assert p.schedule == "primepar" and p.layers == r.best.strategies
    # A plan mixes primepar with nothing else.
    mixed = {**d, "layers": d["layers"][:-1] + [{"schedule": "megatron"}]}
    with pytest.raises(UserError, match="runs it on all layers or none"):
        plans.from_json(mixed)
    with pytest.raises(UserError, match="need rules 'primepar'"):
        plans.from_json({**d, "rules": "tp", "mesh": {"data": 2, "tensor": 4}})
    with pytest.raises(UserError, match="no primepar square fits 6 devices"):
        search(cfg, hw, global_batch=16, seq_len=128, schedules=("primepar",), n_devices=6)


@pytest.mark.slow
def test_primepar_plan_then_train(tmp_path):
    from tests.scriptrun import run_script

    plan = tmp_path / "plan.json"
    r = run_script("plan.py", "--model", "tiny", "--cluster", "cpu-8", "--global-batch", "8",
                   "--seq-len", "32", "--schedules", "primepar", "--json", str(plan), timeout=120)
    assert r.returncode == 0, r.stderr
    d = plans.load(plan)
    assert d.mesh == "data=2,tp_row=2,tp_col=2" and d.rules == "primepar"
    r = run_script("train.py", "--model", "tiny", "--plan", str(plan), "--steps", "2",
                   "--out-dir", str(tmp_path / "run"), "--no-progress", "--eval-batches", "0",
                   timeout=300)
    assert r.returncode == 0, r.stderr
    assert "loss" in r.stdout


def test_vocab_parallel_head_collectives_by_hand():
    # tensor=4 (not primepar): two all-reduces of T D e = 32768 B, each 2 (3/4) S / B + 6 a =
    # 55.152 us, and three of T 4 = 512 B, each 0.768 + 6 = 6.768 us.
    plain = Layout(tensor=4, global_batch=8, seq_len=16)
    hw = Hardware(CLUSTER)
    assert head_tensor_comm_s(CFG, plain, hw) == pytest.approx((2 * 55.152 + 3 * 6.768) * US)
    assert head_tensor_comm_s(CFG, LAYOUT, hw) == 0.0  # primepar's are in head_extra
    one = Layout(global_batch=8, seq_len=16)
    assert head_tensor_comm_s(CFG, one, hw) == 0.0
