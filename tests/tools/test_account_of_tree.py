"""benchmarks/account_of_tree.py: the account of the program another source tree compiles, read
by this tree's analysis. Given this tree itself, it must equal inspect_hlo.py's own account of
the same flags; a path that is no source tree is a one-line error."""

import json
import os
import subprocess
import sys

from tests.scriptrun import ROOT, run_script

FLAGS = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--mesh", "data=2,tensor=4"]


def _account_of_tree(*args: str):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "account_of_tree.py"),
                           *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)


def test_this_tree_gives_inspect_hlos_account(tmp_path):
    theirs, ours = tmp_path / "tree.json", tmp_path / "ours.json"
    proc = _account_of_tree(str(ROOT), "--target", "cpu-8", "--json", str(theirs), "--", *FLAGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compute by roofline" in proc.stdout
    ref = run_script("inspect_hlo.py", *FLAGS, "--json", str(ours))
    assert ref.returncode == 0, ref.stderr[-2000:]
    got, want = json.loads(theirs.read_text()), json.loads(ours.read_text())["fusions"]
    assert got["non_gemm"]["bytes"] == want["non_gemm"]["bytes"] > 0
    assert got["gemm"]["flops"] == want["gemm"]["flops"] > 0
    assert got["non_gemm_by_category"].keys() == want["non_gemm_by_category"].keys()


def test_a_path_without_the_script_is_one_line(tmp_path):
    proc = _account_of_tree(str(tmp_path), "--", *FLAGS)
    assert proc.returncode == 2
    assert "has no scripts/inspect_hlo.py" in proc.stderr.strip().splitlines()[-1]
