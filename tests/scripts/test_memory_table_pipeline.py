"""memory_table.py --pipeline: per-stage memory of pipelined steps without remat, with uniform
full remat and with Merak's ratios, every run checked before the first compile."""

import json

import pytest

from tests.scriptrun import run_script


def test_bad_ratios_exit_2_before_compiling():
    proc = run_script("memory_table.py", "--pipeline", "1f1b", "--r0", "0.5,0.5",
                      "--cpu-devices", "8", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "memory_table.py: error: 2 recompute ratios (0.5, 0.5) for S=4 stages: give one per "
        "stage, or one first-stage ratio r0")


@pytest.mark.slow
def test_rows_per_stage(tmp_path):
    out = tmp_path / "mem.json"
    proc = run_script("memory_table.py", "--pipeline", "1f1b", "--mesh", "data=4,stage=2",
                      "--models", "tiny", "--model-set", "n_layers=10", "--batch-size", "16",
                      "--seq-len", "32", "--microbatches", "4", "--dtype", "float32",
                      "--cpu-devices", "8", "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["stage"]) for r in rows] == [
        (v, s) for v in ("no remat, 1f1b", "uniform full remat, 1f1b",
                         "Merak's ratios r0=0.8, 1f1b") for s in (0, 1)]
    none, full, merak = rows[0:2], rows[2:4], rows[4:6]
    assert [r["ratio"] for r in merak] == [0.8, 0.0]  # S=2: r_1 = 0
    assert merak[0]["recompute_over_forward"] > 0 == merak[1]["recompute_over_forward"]
    assert full[0]["held_bytes"] < merak[0]["held_bytes"] < none[0]["held_bytes"]
    for r in rows:  # XLA's peak - the pools + what the stage holds
        assert r["stage_peak_bytes"] == r["peak_bytes"] - r["pool_bytes"] + r["held_bytes"]
    assert out.with_suffix(".txt").read_text().startswith("python ")
