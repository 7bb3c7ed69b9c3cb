"""scripts/plan.py --verify end to end on 8 CPU devices, and the verified plan read back by
scripts/inspect_hlo.py --plan with the model the plan names."""

import json

import pytest

from tests.scriptrun import run_script


@pytest.mark.slow
def test_verify_writes_the_fastest_plan_that_fits_and_inspect_reads_its_model(tmp_path):
    out = tmp_path / "plan.json"
    r = run_script("plan.py", "--model", "tiny", "--cluster", "cpu-8", "--global-batch", "8",
                   "--seq-len", "32", "--verify", "2", "--json", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(out.read_text())
    block = plan["verified"]
    assert block["target"] == "local" and block["chosen_by"] == "simulated_step_s"
    cands = block["candidates"]
    assert [c["rank"] for c in cands if not c["baseline"]] == [1, 2]
    assert all(c["fits"] for c in cands) and all(c["rank"] > 2 for c in cands if c["baseline"])
    (chosen,) = [c for c in cands if c["rank"] == block["chosen"]]
    assert chosen["simulated_step_s"] == min(c["simulated_step_s"] for c in cands)
    assert plan["mesh"] == chosen["mesh"] and plan["rules"] == chosen["rules"]
    assert plan["predicted_step_s"] == chosen["predicted_step_s"]
    assert "<- chosen" in r.stdout and f"chosen: {chosen['label']}" in r.stdout
    # The chosen plan compiled again by inspect_hlo.py, which takes the model from the plan.
    report = tmp_path / "report.json"
    r = run_script("inspect_hlo.py", "--plan", str(out), "--json", str(report), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["model"] == plan["model_config"] and rep["schedule"] == "plan"
    assert rep["peak_memory_bytes"] == chosen["compiled_peak_memory_bytes"]
    assert rep["simulated_step_s"] == pytest.approx(chosen["simulated_step_s"], rel=1e-9)
    assert rep["planner_predicted_step_s"] == plan["predicted_step_s"]
    # A flag that changes the plan's model is still an error.
    r = run_script("inspect_hlo.py", "--plan", str(out), "--model-set", "n_heads=4",
                   timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert "with n_heads=8, but --model-set/--dtype gives n_heads=4" in errors[0]


@pytest.mark.parametrize("args, message", [
    (["--cluster", "v100-32", "--global-batch", "32", "--verify", "2"],
     "has no compile target"),
    (["--verify", "-1"], "--verify -1 must be >= 0"),
])
def test_verify_errors_are_one_line(tmp_path, args, message):
    out = tmp_path / "plan.json"
    r = run_script("plan.py", "--model", "tiny", *args, "--json", str(out), timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
    assert not out.exists()


def test_tables_print_each_plan_whole():
    """The ranked and compare tables size their plan column to the longest description: a
    mixed-remat plan (over 56 characters) is printed whole, not cut."""
    from oases_jax.hardware import get_cluster
    from oases_jax.models.presets import get_preset
    from oases_jax.planner import make_plan

    cfg = get_preset("oases-h2048-l24")
    _, r = make_plan(cfg, model="oases-h2048-l24", cluster=get_cluster("3090-pcie-32"),
                     global_batch=64, seq_len=1024)
    best, mega = r.best.summary(), r.baselines["megatron"].summary()
    assert len(best) > 56
    out = run_script("plan.py", "--cluster", "3090-pcie-32", "--global-batch", "64",
                     "--compare", "oases-h2048-l24", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert best in out.stdout and mega in out.stdout
    ranked = run_script("plan.py", "--model", "oases-h2048-l24", "--cluster", "3090-pcie-32",
                        "--global-batch", "64", "--seq-len", "1024", timeout=300)
    assert ranked.returncode == 0, ranked.stderr[-3000:]
    assert best in ranked.stdout


def test_a_float32_plan_for_a_bfloat16_device_says_so():
    args = ("--model", "llama2-7b", "--cluster", "h100-8", "--global-batch", "8", "--seq-len",
            "2048", "--top", "1")
    r = run_script("plan.py", *args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "llama2-7b is planned in float32" in r.stderr
    assert "--model-set dtype=bfloat16" in r.stderr
    r = run_script("plan.py", *args, "--model-set", "dtype=bfloat16", timeout=300)
    assert r.returncode == 0 and "float32" not in r.stderr
