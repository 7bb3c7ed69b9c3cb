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
