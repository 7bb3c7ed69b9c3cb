"""scripts/plan.py --pipeline: the 3D search beside the 2D one, the faster written."""

import json

from tests.scriptrun import run_script


def test_pipeline_plan_is_written_when_faster(tmp_path):
    """GPT-2 1.5B on h100-64 (25 heads: no tensor degree inside a node divides them): the 2D
    plan is data=64 with its gradient all-reduce across nodes exposed; a 3D plan with 8 stages
    is faster, so plan.py writes it with its stage section, Megatron-LM's plan printed beside."""
    out = tmp_path / "plan.json"
    r = run_script("plan.py", "--model", "gpt2-1.5b", "--model-set", "dtype=bfloat16",
                   "--cluster", "h100-64", "--global-batch", "128", "--seq-len", "1024",
                   "--pipeline", "--top", "3", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Megatron-LM's 3D plan" in r.stdout and "the 3D plan is chosen" in r.stdout
    plan = json.loads(out.read_text())
    pipe = plan["pipeline"]
    assert plan["mesh"]["stage"] == pipe["stages"] > 1
    assert sum(pipe["stage_layers"]) == 48 and len(pipe["remat_ratios"]) == pipe["stages"]
    assert len(plan["alternatives"]) == 2


def test_pipeline_refuses_moe_models_and_verify(tmp_path):
    for extra in (["--model", "tiny-moe"], ["--model", "tiny", "--verify", "1"]):
        r = run_script("plan.py", *extra, "--cluster", "cpu-8", "--global-batch", "8",
                       "--seq-len", "32", "--pipeline", timeout=300)
        errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
        assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
        assert "--pipeline" in errors[0]
