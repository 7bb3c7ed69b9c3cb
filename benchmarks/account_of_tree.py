"""The per-op account (`oases_jax.tools.analysis.fusions`) of the train step another source tree
compiles, read by this tree's analysis: e.g. the program a past commit built, before the
account or its name scopes existed.

    git worktree add /tmp/before cf35051
    python benchmarks/account_of_tree.py /tmp/before --target h100:1 -- --model gpt2-1.5b \\
        --model-set dtype=bfloat16 --model-set remat=full --seq-len 1024 --batch-size 8 \\
        --target h100:1 --mesh data=1

The other tree's `scripts/inspect_hlo.py` runs with the given flags in a child process whose
`tools.inspection.analyze` also writes the compiled HLO text; this tree then parses, simulates
and accounts it for `--target`'s device. Trees whose analysis is not `tools.inspection.analyze`
(or not named so) are refused with the reason."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import runpy, sys
sys.path.insert(0, {tree!r})
import oases_jax.tools.inspection as ti
if not hasattr(ti, "analyze"):
    sys.exit("the tree's tools.inspection has no `analyze` to wrap")
_analyze = ti.analyze
def analyze(compiled, mesh):
    open({out!r}, "w").write(compiled.as_text())
    return _analyze(compiled, mesh)
ti.analyze = analyze
sys.argv = ["inspect_hlo.py"] + {args!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tree", help="the other source tree (a git worktree of another commit)")
    p.add_argument("--target", default="h100:1", help="whose device prices the account")
    p.add_argument("--json", help="write the account summary as JSON")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    args = argv[cut + 1:]
    if not args:
        p.error("give the tree's inspect_hlo.py flags after --")
    tree = pathlib.Path(a.tree).resolve()
    script = tree / "scripts" / "inspect_hlo.py"
    if not script.is_file():
        p.error(f"{tree} has no scripts/inspect_hlo.py; pass a source tree of this project")
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp, "program.hlo")
        code = CHILD.format(tree=str(tree), out=str(out), args=args, script=str(script))
        env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, text=True,
                              capture_output=True)
        print(proc.stdout, end="")
        if proc.returncode or not out.exists():
            lines = proc.stderr.strip().splitlines()
            sys.exit(f"account_of_tree.py: the tree's inspect_hlo.py failed: "
                     f"{lines[-1] if lines else proc.returncode}")
        text = out.read_text()
    from oases_jax.hardware import get_cluster
    from oases_jax.tools.analysis import fusions
    from oases_jax.tools.analysis.program import analyze_text
    from oases_jax.tools.analysis.simulate import simulate

    cluster = get_cluster(a.target)
    analysis, program = analyze_text(text)
    summary = fusions.summarize(fusions.account(program, cluster.device_spec))
    print(f"this tree's analysis on {a.target}: simulated step "
          f"{simulate(program, cluster).step_s * 1e3:.2f} ms, {analysis.flops / 1e12:.3f} TFLOP")
    print(fusions.format_summary(summary))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
