"""inspect_hlo.py on a pipelined step: --timeline draws one row per stage (tick by tick, from
`analysis.pipeline_time`) and the report carries each stage's recompute and memory."""

import json

import pytest

from tests.scriptrun import run_script


def test_timeline_png_and_per_stage_report(tmp_path):
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "stages.png", tmp_path / "report.json"
    proc = run_script("inspect_hlo.py", "--model", "tiny", "--mesh", "data=4,stage=2",
                      "--pipeline", "merak", "--microbatches", "4", "--batch-size", "16",
                      "--seq-len", "32", "--timeline", str(png), "--json", str(out),
                      "--cpu-devices", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    p = json.loads(out.read_text())["pipeline"]
    assert p["stages"] == 2 and len(p["rows"]) == p["ticks"] == len(p["tick_s"])
    flops, memory = p["per_stage"]["flops"], p["per_stage"]["memory"]
    assert flops["recompute"][1] == 0 < flops["recompute"][0]  # Merak's: the last stage never
    assert len(memory["held_bytes"]) == 2 and memory["pool_bytes"] > 0
    assert "recompute FLOPs / forward FLOPs per stage" in proc.stdout
    assert "activations per stage (MiB)" in proc.stdout


def test_spmd_pipeline_timeline_is_the_whole_program(tmp_path):
    """1f1b_spmd has no tick switch: --timeline draws the whole program's two streams (the
    replay is its step) and the report has no tick table."""
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "spmd.png", tmp_path / "report.json"
    proc = run_script("inspect_hlo.py", "--model", "tiny", "--mesh", "stage=2,tensor=4",
                      "--pipeline", "1f1b_spmd", "--schedule", "collective_matmul",
                      "--microbatches", "4", "--batch-size", "16", "--seq-len", "32",
                      "--timeline", str(png), "--json", str(out), "--cpu-devices", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    r = json.loads(out.read_text())
    assert r["pipeline"] is None and r["simulated_step_s"] > 0
    assert "no per-stage timeline" not in proc.stderr


def test_shares_of_the_step_by_hand():
    """S=2, five ticks F0 | F1 | B1 | R0 | B0 (costs 1, 1, 2, 1, 3; one stage busy each):
    switch time 8, stage 0 busy 5 and stage 1 busy 3, so the stages wait 3 and 5 (mean 4) of a
    step of 8 + 2 outside = 10. Stage 0's backward recomputes 6 of its 30 FLOPs, so its
    recompute is R's 1 + 3 x 0.2 = 1.6, stage 1's 0: mean 0.8 of 10."""
    from oases_jax.tools.pipeline_report import schedules_table, shares

    def branch(kind, j, cost):
        return {"kind": kind, "virtual_stage": j, "step_s": cost}

    p = {"schedule": "hand", "stages": 2, "ticks": 5, "step_s": 10.0, "switch_s": 8.0,
         "outside_s": 2.0, "busy_s": [5.0, 3.0], "exposed_comm_s": 1.0,
         "branches": [branch("IDLE", -1, 0.0), branch("F", 0, 1.0), branch("B", 0, 3.0),
                      branch("F", 1, 1.0), branch("B1", 1, 2.0), branch("R", 0, 1.0)],
         # per tick, per lane (one), per stage: (branch, micro-batch)
         "rows": [[[[1, 0], [0, -1]]], [[[0, -1], [3, 0]]], [[[0, -1], [4, 0]]],
                  [[[5, 0], [0, -1]]], [[[2, 0], [0, -1]]]],
         "per_stage": {"flops": {"recompute_b": [6.0, 0.0], "backward": [30.0, 20.0]}},
         "events": {"makespan_s": 7.0}}
    sh = shares({"pipeline": p})
    assert sh["bubble"] == pytest.approx(0.4) and sh["exposed_comm"] == pytest.approx(0.1)
    assert sh["recompute"] == pytest.approx(0.08)
    assert sh["idle_per_stage"] == pytest.approx([0.3, 0.5])
    table = schedules_table([{"pipeline": p, "peak_memory_bytes": 2**30}])
    assert "hand" in table and "40.0%" in table and "8.0%" in table and "9000.0" in table
