"""scripts/plan.py on MoE models end to end: a small-moe plan for 8 CPU devices that
scripts/train.py --plan trains and scripts/inspect_hlo.py --plan compiles, and --verify of MoE
plans compiled for h100:8 without a GPU."""

import json
import math

import pytest

from oases_jax.targets import has_gpu_aot
from tests.scriptrun import run_script


@pytest.mark.slow
def test_small_moe_plan_for_cpu8_trains_and_compiles(tmp_path):
    out = tmp_path / "plan.json"
    r = run_script("plan.py", "--model", "small-moe", "--cluster", "cpu-8", "--global-batch",
                   "16", "--seq-len", "64", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(out.read_text())
    moe = plan["moe"]
    assert moe["expert"] == plan["mesh"].get("expert", 1)
    assert moe["schedule"] in ("local", "parm_s1", "parm_s2", "ds_moe")
    run = tmp_path / "run"
    r = run_script("train.py", "--model", "small-moe", "--plan", str(out), "--steps", "3",
                   "--log-every", "1", "--eval-every", "100", "--eval-batches", "1",
                   "--no-progress", "--out-dir", str(run), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row and "step" in row]
    assert len(losses) >= 3 and all(math.isfinite(v) for v in losses)
    # The plan's whole train step, compiled by inspect_hlo.py with the plan's own model.
    report = tmp_path / "report.json"
    r = run_script("inspect_hlo.py", "--plan", str(out), "--json", str(report), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["moe_schedule"] == moe["schedule"]
    assert rep["planner_predicted_step_s"] == plan["predicted_step_s"]


@pytest.mark.slow
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
def test_moe_plans_verified_on_h100_report_the_ranking_agreement(tmp_path):
    out = tmp_path / "plan.json"
    r = run_script("plan.py", "--model", "tiny-moe", "--model-set", "dtype=bfloat16",
                   "--cluster", "h100-8", "--global-batch", "16", "--seq-len", "128",
                   "--verify", "3", "--json", str(out), timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(out.read_text())
    block = plan["verified"]
    assert block["target"] == "h100:8" and len(block["candidates"]) == 3
    assert all(c["fits"] and c["simulated_step_s"] > 0 for c in block["candidates"])
    chosen = block["candidates"][block["chosen"] - 1]
    assert plan["mesh"] == chosen["mesh"] and "moe" in plan
    assert f"moe {plan['moe']['schedule']}" in chosen["label"]
    assert "ranking agreement (Spearman)" in r.stdout
