"""The MoE sweep: every row's auto choice is the cheapest of ds_moe, S1 and S2 under the model;
the script writes its JSON."""

import json

from oases_jax.planner.cost.moe_cost import summary, sweep
from tests.scriptrun import run_script

SMALL = {"experts": (8, 32), "hidden": (768, 2048), "tokens": (1024, 16384), "top_k": (1, 2),
         "capacity_factor": (1.0,)}


def test_auto_is_the_cheapest_schedule():
    rows = sweep(grid=SMALL)
    assert len(rows) == 2 * 16
    for r in rows:
        assert r["auto_s"] <= min(r["ds_moe_s"], r["parm_s1_s"], r["parm_s2_s"]) * (1 + 1e-12)
        assert r["speedup"] >= 1.0
    s = summary(rows)
    assert set(s) == {"h100-8", "v100-32"} and s["v100-32"]["s2_chosen"] > 0


def test_script_writes_rows(tmp_path):
    out = tmp_path / "sweep.json"
    proc = run_script("moe_sweep.py", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| h100-8 | 108 |" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 216 and set(data["summary"]) == {"h100-8", "v100-32"}
