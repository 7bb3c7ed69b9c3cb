"""Result files' provenance: the commit, versions, command and date, checked against git and
the running jax themselves."""

import datetime
import json
import pathlib
import subprocess

import jax

from oases_jax import provenance
from tests.scriptrun import ROOT, run_script


def test_the_record_names_this_checkouts_commit_and_versions():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    r = provenance.record(["scripts/bench.py", "--model", "tiny", "--json", "a b.json"])
    assert r["commit"] == head
    assert r["jax"] == jax.__version__
    assert r["command"] == "python scripts/bench.py --model tiny --json 'a b.json'"
    age = datetime.datetime.now(datetime.UTC) - datetime.datetime.fromisoformat(r["date"])
    assert abs(age.total_seconds()) < 60
    assert provenance.record(["/usr/bin/oases-plan", "--explain"])["command"] == (
        "oases-plan --explain")
    first, second = provenance.header(["scripts/plan.py"]).splitlines()
    assert first == "python scripts/plan.py"
    assert second.startswith("# commit " + head[:12]) and jax.__version__ in second


def test_a_scripts_json_carries_it(tmp_path):
    out = tmp_path / "sweep.json"
    done = run_script("moe_sweep.py", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    made = json.loads(out.read_text())
    assert {"command", "commit", "dirty", "jax", "jaxlib", "date"} <= set(made)
    assert made["command"].startswith("python scripts/moe_sweep.py --out ")
    assert pathlib.Path(made["command"].split()[-1]) == out
