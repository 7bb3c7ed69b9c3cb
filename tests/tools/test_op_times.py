"""tools/op_times.py: traced op times attributed to the account's ops and categories, by hand on
synthetic traces and a small compiled program, and end to end through bench.py --op-times."""

import json

import jax
import jax.numpy as jnp
import pytest

from oases_jax.analysis import fusions
from oases_jax.analysis.hardware import get_cluster
from oases_jax.analysis.program import Program
from tests.scriptrun import run_script
from tools.op_times import compare, op_seconds

DEVICE = get_cluster("h100:1").device_spec


def _x(pid, name, dur_us, **args):
    return {"ph": "X", "pid": pid, "name": name, "dur": dur_us, "args": args}


def test_device_timeline_events_by_hlo_op_or_kernel_name():
    """A GPU trace: only the first device's kernels count, named by `hlo_op` or their own name;
    host events (launches carrying the same hlo_op) are not counted twice."""
    names = {1: "/host:CPU", 2: "/device:GPU:0", 3: "/device:GPU:1"}
    events = [_x(2, "sm90_xmma_gemm", 100, hlo_op="gemm_fusion_dot.3"),
              _x(2, "loop_add_fusion_3", 40), _x(2, "loop_add_fusion_3", 20),
              _x(3, "loop_add_fusion_3", 999), _x(1, "launch", 500, hlo_op="gemm_fusion_dot.3"),
              {"ph": "M", "pid": 2, "name": "process_name"}]
    assert op_seconds(events, names) == pytest.approx(
        {"gemm_fusion_dot.3": 100e-6, "loop_add_fusion_3": 60e-6})


def test_host_thunks_of_the_lowest_device_ordinal():
    """A CPU trace: thunk events with an `hlo_op`, the lowest device ordinal's only."""
    names = {7: "/host:CPU"}
    events = [_x(7, "ynn_fusion", 30, hlo_op="fusion.2", device_ordinal=1),
              _x(7, "ynn_fusion", 10, hlo_op="fusion.2", device_ordinal=0),
              _x(7, "ynn_fusion", 5, hlo_op="fusion.2", device_ordinal=0),
              _x(7, "ThreadpoolListener::Record", 70)]
    assert op_seconds(events, names) == pytest.approx({"fusion.2": 15e-6})


def test_compare_sums_the_measured_ops_by_the_accounts_categories():
    """Measured seconds land on the category the account gives each op (kernel spellings with
    underscores match dotted op names); ops it does not cost are unattributed."""
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    program = Program(f.lower(x, x).compile().as_text())
    rows = fusions.account(program, DEVICE)
    assert rows
    measured = {r.name.replace(".", "_"): 1e-3 * (i + 1) for i, r in enumerate(rows)}
    measured["all-reduce.7"] = 5e-3
    got = compare(program, DEVICE, measured)
    want = {}
    for i, r in enumerate(rows):
        want[r.category] = want.get(r.category, 0.0) + 1e-3 * (i + 1)
    assert {c["category"]: c["measured_s"] for c in got["categories"]} == pytest.approx(want)
    assert got["roofline_s"] == pytest.approx(sum(r.total_s for r in rows))
    assert got["unattributed_s"] == pytest.approx(5e-3)
    assert got["measured_s"] == pytest.approx(sum(measured.values()))


def test_bench_op_times_end_to_end(tmp_path):
    """bench.py --op-times on 8 CPU devices: every variant's report carries the table, the
    profiler saw the program's ops (most of the measured time claimed by costed ops), and the
    roofline column is the account of the compiled step."""
    out = tmp_path / "bench.json"
    proc = run_script("bench.py", "--model", "tiny", "--variant", "data=2,tensor=4/tp/megatron",
                      "--batch-size", "8", "--seq-len", "32", "--rounds", "1", "--warmup", "1",
                      "--op-times", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "measured/roof" in proc.stdout
    (row,) = json.loads(out.read_text())["variants"]
    ops = row["op_times"]
    cats = {c["category"]: c for c in ops["categories"]}
    assert {"gemm", "optimizer", "norm"} <= cats.keys()
    assert all(c["measured_s"] > 0 for c in cats.values() if c["category"] == "gemm")
    assert ops["measured_s"] - ops["unattributed_s"] > 0


def test_op_times_must_not_be_negative():
    proc = run_script("bench.py", "--model", "tiny", "--op-times", "-1")
    assert proc.returncode == 2
    assert "--op-times -1 must be >= 0" in proc.stderr.strip().splitlines()[-1]
