"""tools/op_times.py: traced op times attributed to the account's ops and categories, by hand on
synthetic traces and a small compiled program, and end to end through bench.py --op-times."""

import json

import jax
import jax.numpy as jnp
import pytest

from oases_jax.hardware import get_cluster
from oases_jax.tools.analysis import fusions
from oases_jax.tools.analysis.program import Program
from oases_jax.tools.op_times import compare, kernel_category, op_seconds
from tests.scriptrun import run_script

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


def test_kernels_in_a_command_buffer_go_by_their_own_name():
    """Inside a CUDA graph every kernel's hlo_op is the command buffer's name (seen on an H100,
    jax 0.11.2): a fusion's kernel is then known by its own name, which is the fusion's."""
    names = {2: "/device:GPU:0"}
    events = [_x(2, "loop_add_fusion_30", 10, hlo_op="command_buffer_1"),
              _x(2, "nvjet_sm90_tst_128x128_64x6_1x4_h_bz_NNT", 50, hlo_op="command_buffer_1"),
              _x(2, "loop_add_fusion_30", 5, hlo_op="command_buffer_7"),
              _x(2, "gemm_fusion_dot_2", 7, hlo_op="gemm_fusion_dot.2")]
    assert op_seconds(events, names) == pytest.approx(
        {"loop_add_fusion_30": 15e-6, "nvjet_sm90_tst_128x128_64x6_1x4_h_bz_NNT": 50e-6,
         "gemm_fusion_dot.2": 7e-6})


def test_library_kernels_by_name():
    """Kernels that name no HLO op land on a category by their name: cuBLAS GEMMs, cuDNN's
    attention, device copies; anything else stays unattributed."""
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    program = Program(f.lower(x, x).compile().as_text())
    measured = {"nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN": 4e-3,
                "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": 3e-3,
                "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>": 1e-3,
                "memcpy128": 2e-3, "Memset 0": 0.5e-3, "some_unknown_kernel": 9e-3}
    assert [kernel_category(k) for k in measured] == [
        "gemm", "attention_kernel", "attention_kernel", "copy", "copy", None]
    got = compare(program, DEVICE, measured)
    cats = {c["category"]: c["measured_s"] for c in got["categories"]}
    assert cats["gemm"] == pytest.approx(4e-3)
    assert cats["attention_kernel"] == pytest.approx(4e-3)
    assert cats["copy"] == pytest.approx(2.5e-3)
    assert got["unattributed_s"] == pytest.approx(9e-3)
    assert got["top_measured"][0] == {"op": "nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN",
                                      "category": "gemm", "measured_s": 4e-3, "roofline_s": 0.0}


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


def test_a_kept_trace_attributes_later_against_the_same_program(tmp_path):
    """bench.py --trace-dir keeps each variant's profiler trace under DIR/LABEL;
    inspect_hlo.py --op-trace reads it back against its own compile of the same program (how a
    GPU run's trace is attributed here) and finds the ops bench.py's report found."""
    out = tmp_path / "bench.json"
    flags = ("--model", "tiny", "--cpu-devices", "1", "--batch-size", "2", "--seq-len", "16")
    proc = run_script("bench.py", *flags, "--variant", "one:data=1/tp/megatron",
                      "--rounds", "1", "--warmup", "1", "--op-times", "2", "--trace-dir",
                      str(tmp_path / "tr"), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["variants"]
    report = tmp_path / "inspect.json"
    proc = run_script("inspect_hlo.py", *flags, "--mesh", "data=1", "--op-trace",
                      str(tmp_path / "tr" / "one"), "--op-trace-steps", "2", "--json",
                      str(report))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "measured/roof" in proc.stdout
    later = json.loads(report.read_text())["op_times"]
    assert later["measured_s"] == pytest.approx(row["op_times"]["measured_s"])
    # The same ops claimed, category by category: the two compiles name their ops alike.
    assert later["unattributed_s"] == pytest.approx(row["op_times"]["unattributed_s"])
    assert {c["category"]: c["measured_s"] for c in later["categories"]} == pytest.approx(
        {c["category"]: c["measured_s"] for c in row["op_times"]["categories"]})
    assert later["measured_s"] > later["unattributed_s"]


def test_op_trace_missing_is_one_line(tmp_path):
    proc = run_script("inspect_hlo.py", "--model", "tiny", "--op-trace", str(tmp_path))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert str(tmp_path) in last and "--trace-dir" in last


def test_trace_dir_needs_op_times(tmp_path):
    proc = run_script("bench.py", "--model", "tiny", "--trace-dir", str(tmp_path))
    assert proc.returncode == 2
    assert "--trace-dir" in proc.stderr.strip().splitlines()[-1]
    assert "--op-times" in proc.stderr.strip().splitlines()[-1]


def test_op_times_must_not_be_negative():
    proc = run_script("bench.py", "--model", "tiny", "--op-times", "-1")
    assert proc.returncode == 2
    assert "--op-times -1 must be >= 0" in proc.stderr.strip().splitlines()[-1]
