"""scripts/inspect_hlo.py end to end: local and GPU targets, reports, comparisons, bad input."""

import dataclasses
import json

import pytest

from oases_jax.targets import has_gpu_aot
from tests.scriptrun import run_script

KEYS = {"target", "collectives", "overlap_share", "peak_memory_bytes", "flops",
        "simulated_step_s", "compute_s", "exposed_comm_s"}


def run(*args, timeout=600):
    return run_script("inspect_hlo.py", *args, timeout=timeout)


def test_local_train_step_report(tmp_path):
    out = tmp_path / "r.json"
    proc = run("--model", "tiny", "--mesh", "data=2,tensor=4", "--batch-size", "8",
               "--seq-len", "32", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert KEYS <= set(r) and r["target"] == "local" and r["mesh"] == "data=2,tensor=4"
    kinds = {c["kind"] for c in r["collectives"]}
    assert "all-reduce" in kinds  # Megatron's tensor-parallel reductions (and data-parallel grads)
    axes = {tuple(c["axes"]) for c in r["collectives"]}
    assert ("tensor",) in axes and any("data" in a for a in axes)
    assert all(not c["is_async"] for c in r["collectives"])  # CPU collectives are synchronous
    assert r["overlap_share"] == 0.0
    assert r["xla_estimate"] is None  # XLA's estimate comes from its GPU scheduler only
    # Hand count: 6 N per token (forward + backward matmuls) plus attention, per device.
    from oases_jax.models import get_preset

    cfg = get_preset("tiny")
    expected = cfg.flops_per_token(32) * 8 * 32 / 8
    assert 0.8 < r["flops"] / expected < 1.25
    assert "collective" in proc.stdout and "simulated" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (("--target", "tpu:8"), "tpu:8"),
    (("--target", "h100:12"), "h100:12"),
    (("--model", "nope"), "nope"),
    (("--mesh", "tensor=3"), "tensor=3"),
    (("--diff", "megatron"), "two entries"),
    (("--timeline-source", "xla", "--timeline", "t.png"), "GPU target"),
])
def test_bad_input(args, needle):
    proc = run("--model", "tiny", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and needle in errors[0], proc.stderr


@pytest.mark.gpu_aot
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
def test_megatron_layer_on_h100_exposes_its_communication(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "t.png"
    proc = run("--model", "small", "--target", "h100:8", "--mesh", "tensor=8", "--layer",
               "--compare", "megatron,megatron_sp", "--json", str(out), "--timeline", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    megatron, sp = json.loads(out.read_text())
    assert megatron["target"] == "h100:8" and megatron["cluster"] == "h100:8"
    # Megatron's all-reduces wait for the projection that feeds them: nearly all exposed. The
    # forward's two (half the bytes) cannot have a GEMM beside them; the backward's may sit
    # beside the independent weight-gradient GEMMs.
    assert megatron["exposed_comm_s"] >= 0.8 * megatron["comm_s"] > 0
    assert megatron["gemm_overlap_share"] <= 0.5
    assert {c["kind"] for c in megatron["collectives"]} == {"all-reduce"}
    assert {"all-gather", "reduce-scatter"} <= {c["kind"] for c in sp["collectives"]}
    assert png.exists() and (tmp_path / "t-megatron_sp.png").exists()
    assert "ratio" in proc.stdout
    # XLA's own estimate of the same compile, beside ours.
    x = megatron["xla_estimate"]
    assert x["step_s"] > 0 and set(x["exposed_comm_s"]) == {"all-reduce", "total"}
    assert 0 < x["exposed_comm_s"]["total"] <= x["comm_s"]["total"] < x["step_s"]
    assert {o["stream"] for o in x["per_op"]} == {"compute", "comm"}
    assert "XLA's estimate" in proc.stdout and "XLA step" in proc.stdout
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(megatron))
    b.write_text(json.dumps(sp))
    diff = run("--diff", f"{a},{b}")
    assert diff.returncode == 0, diff.stderr[-2000:]
    assert "all-reduce" in diff.stdout and "peak_memory_bytes" in diff.stdout


def _write_plan(path, layers, mesh=None, **extra):
    plan = {"model": "tiny", "cluster": "cpu-8", "global_batch": 8, "seq_len": 32,
            "mesh": mesh or {"data": 2, "tensor": 4}, "rules": "tp", "microbatches": 2,
            "layers": layers, "predicted_step_s": 0.0125, **extra}
    path.write_text(json.dumps(plan))
    return str(path)


def test_plan_compiles_each_layer_under_its_own_strategy(tmp_path):
    # A ring layer and an Oases layer with full remat, two micro-batches.
    layers = [{"schedule": "collective_matmul", "sub_batches": 1, "remat": "none"},
              {"schedule": "oases", "sub_batches": 2, "remat": "full"}]
    out = tmp_path / "r.json"
    proc = run("--model", "tiny", "--plan", _write_plan(tmp_path / "plan.json", layers),
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert KEYS <= set(r) and r["schedule"] == "plan" and r["layers"] == layers
    assert (r["mesh"], r["batch_size"], r["microbatches"], r["seq_len"]) == \
        ("data=2,tensor=4", 8, 2, 32)
    kinds = {c["kind"] for c in r["collectives"]}
    assert {"collective-permute", "all-reduce"} <= kinds  # the ring layer and the Oases layer
    assert r["planner_predicted_step_s"] == 0.0125 and r["simulated_step_s"] > 0
    assert "1 x collective_matmul+none, 1 x oases/2+full" in proc.stdout
    assert "planner predicted: step    12.500 ms" in proc.stdout


@pytest.mark.parametrize("case, needle", [
    ("not json", "not valid JSON"),
    ("mesh", "has mesh tensor=4 (4 devices) but target local has 8; use --cpu-devices 4"),
    ("flags", "drop --mesh, --batch-size"),
])
def test_bad_plan(tmp_path, case, needle):
    path = tmp_path / "plan.json"
    flags = []
    if case == "not json":
        path.write_text("{nope")
    else:
        _write_plan(path, [{"schedule": "megatron"}] * 2,
                    mesh={"tensor": 4} if case == "mesh" else None)
        if case == "flags":
            flags = ["--mesh", "tensor=8", "--batch-size", "16"]
    proc = run("--model", "tiny", "--plan", str(path), *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and needle in errors[0], proc.stderr


def test_plan_without_model_flag_takes_the_plans_model(tmp_path):
    """A plan naming only its preset (no `model_config`) compiles that preset without --model;
    with neither, --model is asked for."""
    layers = [{"schedule": "megatron"}] * 2
    out = tmp_path / "r.json"
    proc = run("--plan", _write_plan(tmp_path / "plan.json", layers), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from oases_jax.models import get_preset

    assert json.loads(out.read_text())["model"] == dataclasses.asdict(get_preset("tiny"))
    path = tmp_path / "anon.json"
    plan = json.loads((tmp_path / "plan.json").read_text())
    del plan["model"]
    path.write_text(json.dumps(plan))
    proc = run("--plan", str(path))
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode == 2 and len(errors) == 1 and "names no model" in errors[0], \
        proc.stderr[-2000:]


def test_memory_report(tmp_path):
    """`--memory-report N` prints XLA's N largest allocations from the same compile, and the
    JSON keeps them; their total is the program's peak (within alignment)."""
    out = tmp_path / "r.json"
    proc = run("--model", "tiny", "--mesh", "data=2,tensor=4", "--batch-size", "8",
               "--seq-len", "32", "--memory-report", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "XLA's memory-usage report" in proc.stdout and "the 3 largest" in proc.stdout
    r = json.loads(out.read_text())
    rep = r["memory_report"]
    assert abs(rep["total_bytes"] - r["peak_memory_bytes"]) <= 0.01 * r["peak_memory_bytes"]
    sizes = [a["size_bytes"] for a in rep["allocations"]]
    assert sizes == sorted(sizes, reverse=True) and rep["n_allocations"] >= len(sizes)
    bad = run("--model", "tiny", "--memory-report", "-1")
    assert bad.returncode == 2 and "--memory-report -1" in bad.stderr


@pytest.mark.gpu_aot
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
def test_plan_on_a_gpu_without_xla_schedule_tables(tmp_path):
    """A plan for the bridged 3090 cluster, compiled for `3090:32`: simulated on the plan's
    cluster (its bridges, as `plan.py --verify` timed it), not the PCIe cluster `3090:32`
    names. The 3090 (sm_86) has no schedule tables in XLA, so the compile runs without the
    schedule dump: the memory report still comes back, and nothing is dumped to stdout or the
    working directory (it once printed every sub-compile's HLO and left a `-` directory)."""
    out = tmp_path / "r.json"
    plan = _write_plan(tmp_path / "plan.json", [{"schedule": "megatron"}] * 2,
                       mesh={"data": 8, "tensor": 4}, cluster="3090-nvlink-32", microbatches=1,
                       global_batch=16)
    proc = run_script("inspect_hlo.py", "--plan", plan, "--target", "3090:32",
                      "--memory-report", "2", "--json", str(out), timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the 2 largest" in proc.stdout and "HloModule" not in proc.stdout
    r = json.loads(out.read_text())
    assert (r["target"], r["cluster"]) == ("3090:32", "3090-nvlink-32")
    assert "simulated on 3090-nvlink-32" in proc.stdout
    assert r["xla_estimate"] is None and "schedule dump is unavailable" in proc.stderr
    assert abs(r["memory_report"]["total_bytes"] - r["peak_memory_bytes"]) \
        <= 0.01 * r["peak_memory_bytes"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "r.json"]


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allowed"])
def test_a_program_over_the_device_memory_says_so(tmp_path, allow):
    """33M tokens of `small` per step: terabytes of activations, over any host's memory shared
    by its 8 CPU devices. The report is printed and written either way; then one line, and exit
    7 unless --allow-oversize."""
    out = tmp_path / "r.json"
    proc = run("--model", "small", "--batch-size", "131072", "--seq-len", "256", "--mesh",
               "data=8", "--json", str(out), *(("--allow-oversize",) if allow else ()))
    assert proc.returncode == (0 if allow else 7), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "simulated" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("inspect_hlo.py:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    kind = "note" if allow else "error"
    assert lines[0].startswith(f"inspect_hlo.py: {kind}: megatron on local peaks at ")
    assert "share the host's memory): it does not fit" in lines[0]
    peak = json.loads(out.read_text())["peak_memory_bytes"]
    from oases_jax.hardware import host_memory_bytes

    assert peak > host_memory_bytes()
