"""Hostile input, seeded: every mutated plan, cluster and profile file, flag and data path gives
either a clean accept (of a valid input) or one UserError line (exit 2 for flags) that names what
is wrong; never another exception, a multi-line message, a hang or a silent accept of bad input.

Plans (`tests/fuzz/plans.py`, 250+ files, each through `train.py --plan` and
`inspect_hlo.py --plan`), by category:
  valid           the planner's plans and hand-made ones, re-spelled: must load
  wrong_type      floats, integral floats, booleans, strings, lists, objects or null where an
                  integer, name, number or boolean belongs
  non_finite      Infinity, -Infinity, NaN, 1e999 in any numeric field
  range           zero, negative and absurd sizes (10^12, 2^63, 10^30), negative times
  names           unknown schedule, remat, rule set, family, dtype, attention, mesh axis
                  (" data"), preset, format
  structure       top level not an object, missing and misspelled fields, empty or mistyped
                  containers
  duplicate_keys  a key twice in any object
  deep_nesting    40 to 200000 levels of nested lists or objects
  fit             a rule set or schedule that does not fit the mesh, primepar mixed or not
                  square, layer count, micro-batches or sub-batches that do not divide
  version         versions other than 1, a format of another kind
  syntax          truncated, trailing garbage, comments, NUL bytes, not UTF-8
  file_kind       a directory, a FIFO, /dev/zero, /dev/null, a missing file, a dangling link,
                  a link loop, a 2 GiB file
Cluster JSON and calibration profiles (`tests/fuzz/files.py`, 90+ files, through `plan.py
--cluster FILE` and `plan.py --cost-source profile --profile FILE`): valid, wrong_type,
non_finite, range, structure (unknown device, mismatched device_spec, spans that shrink,
unknown source or collective), duplicate_keys, syntax, deep_nesting, file_kind.
Flags (`tests/fuzz/flags.py`): every script's sizes, ratios and rates out of range, `--model-set`
overrides, a schedule or rule set that does not fit the mesh, output paths that are files or
directories where the other belongs, `--coordinator` not HOST:PORT, `--data ""`; parsed and
validated by each script's `main()` with the heavy work stubbed out.
Data paths: empty files (`.bin`, `val.bin`), FIFOs, /dev/zero, /dev/null, directories where a
file belongs, odd-sized or out-of-vocabulary `.bin`, missing files.

`python -m tests.fuzz.test_fuzz_inputs` prints the failure counts by category.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from tests.fuzz import files, flags, plans
from tests.fuzz.harness import HANG_S, Case, Result, run, tally

GROUPS = {"plans": plans.plan_cases, "files": files.file_cases, "flags": flags.flag_cases,
          "data": flags.data_cases}


def run_group(name: str, tmp: pathlib.Path) -> tuple[list[Case], list[Result]]:
    tmp.mkdir(parents=True, exist_ok=True)
    cases = GROUPS[name](tmp)
    return cases, [run(c) for c in cases]


def failures(cases: list[Case], results: list[Result]) -> list[str]:
    return [f"[{c.category}] {c.name}: {why}" for c, r in zip(cases, results, strict=True)
            if (why := r.failure(c)) is not None]


@pytest.mark.parametrize("group", list(GROUPS))
def test_hostile_inputs_give_one_line_errors(group, tmp_path):
    cases, results = run_group(group, tmp_path)
    minimum = {"plans": 200, "files": 50, "flags": 100, "data": 20}[group]
    assert len(cases) >= minimum
    bad = failures(cases, results)
    assert not bad, f"{len(bad)} of {len(cases)} failed:\n" + "\n".join(bad)
    slowest = max(results, key=lambda r: r.seconds)
    assert slowest.seconds < HANG_S
    assert sum(r.outcome == "accept" for r in results) >= 3  # the valid inputs still load


def _scripts_cases(tmp: pathlib.Path) -> list[tuple[str, tuple, str]]:
    import os

    os.mkfifo(tmp / "plan.fifo")
    (tmp / "a-dir").mkdir()
    (tmp / "cluster.json").write_text('{"name": "c", "device": "h100", "n_devices": 8.5, '
                                      '"levels": [[8, {"name": "nv", "bytes_per_s": 4.5e11, '
                                      '"latency_s": 3e-6}]]}')
    return [
        ("train.py", ("--model", "tiny", "--plan", str(tmp / "plan.fifo")), "is a FIFO"),
        ("train.py", ("--coordinator", "notaport", "--num-processes", "2", "--process-id", "0"),
         "--coordinator"),
        ("plan.py", ("--model", "tiny", "--cluster", str(tmp / "cluster.json")),
         "n_devices = 8.5: must be an integer"),
        ("calibrate.py", ("--quick", "--out", str(tmp / "a-dir")), "--out"),
    ]


@pytest.mark.parametrize("i", range(4))
def test_scripts_exit_2_with_one_line(i, tmp_path):
    """The scripts themselves, in a subprocess: exit 2, one line on stderr, in seconds (a FIFO
    hung, `--coordinator notaport` crashed jax.distributed with a segmentation fault)."""
    from tests.scriptrun import run_script

    script, args, needle = _scripts_cases(tmp_path)[i]
    proc = run_script(script, *args, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def main() -> None:
    import os
    import tempfile

    import jax

    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_num_cpu_devices", 8)  # as tests/conftest.py gives the suite
    with tempfile.TemporaryDirectory() as tmp:
        for group in GROUPS:
            cases, results = run_group(group, pathlib.Path(tmp) / group)
            print(f"{group}: {len(cases)} cases, slowest "
                  f"{max(r.seconds for r in results):.3f} s")
            for category, (n_bad, n) in tally(cases, results).items():
                print(f"  {category:<28} {n_bad:4d} of {n:4d} fail")
            if "-v" in sys.argv:
                print("\n".join(f"    {line}" for line in failures(cases, results)))


if __name__ == "__main__":
    main()
