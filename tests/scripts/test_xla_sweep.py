"""scripts/xla_sweep.py end to end: a quick sweep for h100:8 written as an xla profile."""

import json

import pytest

from oases_jax.targets import has_gpu_aot
from tests.scriptrun import run_script


@pytest.mark.gpu_aot
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
def test_quick_sweep_writes_an_xla_profile(tmp_path):
    out, table = tmp_path / "p.json", tmp_path / "t.md"
    proc = run_script("xla_sweep.py", "--quick", "--out", str(out), "--table", str(table),
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["source"] == "xla" and d["device"] == "h100" and d["n_devices"] == 8
    comm = d["samples"]["comm"]
    assert {(s["kind"], s["n"]) for s in comm} == {
        (k, n) for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                         "collective-permute") for n in (2, 4, 8)}
    assert all(s["seconds"] > 0 for s in comm) and len(d["samples"]["gemm"]) == 4
    assert "datasheet" in table.read_text() and "| all-gather | 8 | 1 MiB |" in proc.stdout


def test_local_target_is_refused():
    proc = run_script("xla_sweep.py", "--target", "local", "--out", "x.json")
    assert proc.returncode == 2 and "GPU programs" in proc.stderr, proc.stderr[-2000:]
