"""The benchmark set's table (docs/planner.md, "The benchmark set"): one row per verified plan
JSON that benchmarks/benchmark_set.sh wrote, with the contract's checks: the chosen plan fits;
predicted step within 15% and predicted peak within 10% of the compiled program's, for the
chosen plan and for how many of the top 5; Spearman of the top 5's predicted and simulated
steps; the FSDP-only baseline's simulated step beside.
`python benchmarks/benchmark_set_table.py OUT_DIR`"""

from __future__ import annotations

import json
import pathlib
import sys

from oases_jax.planner.verification.rank import spearman

STEP, PEAK = 0.15, 0.10


def within(c: dict) -> tuple[bool, bool]:
    step = c["simulated_step_s"] and abs(c["predicted_step_s"] / c["simulated_step_s"] - 1) <= STEP
    peak = c["compiled_peak_memory_bytes"] and abs(
        c["predicted_peak_memory_bytes"] / c["compiled_peak_memory_bytes"] - 1) <= PEAK
    return bool(step), bool(peak)


def row(path: pathlib.Path) -> str:
    plan = json.loads(path.read_text())
    block = plan["verified"]
    cands = block["candidates"]
    top = [c for c in cands if not c["baseline"] and c["simulated_step_s"]]
    chosen = next(c for c in cands if c["rank"] == block["chosen"])
    base = next((c for c in cands if c["baseline"] or (
        "fsdp" in c["rules"] and c["mesh"].get("tensor", 1) == 1)), None)
    both = sum(all(within(c)) for c in top)
    rho = spearman([c["predicted_step_s"] for c in top], [c["simulated_step_s"] for c in top])
    ok = all(within(chosen)) and chosen["fits"] and both >= 4 and rho >= 0.8

    def ms(s):
        return f"{s * 1e3:.1f}" if s else "-"

    xla = ms(chosen["xla_step_s"])
    fsdp = f"{ms(base['simulated_step_s'])} ({base['label'].split(':')[0]})" if base else "-"
    return (f"| {path.stem.removeprefix('plan_')} | {chosen['label']} | "
            f"{ms(chosen['predicted_step_s'])} / {ms(chosen['simulated_step_s'])} | "
            f"{chosen['predicted_peak_memory_bytes'] / 2**30:.1f} / "
            f"{chosen['compiled_peak_memory_bytes'] / 2**30:.1f} | {xla} | "
            f"{chosen['gemm_overlap_share']:.2f} | {both} of {len(top)} | {rho:.2f} | {fsdp} | "
            f"{'met' if ok else 'not met'} |")


def main(out: str) -> int:
    paths = sorted(pathlib.Path(out).glob("plan_*.json"))
    if not paths:
        sys.exit(f"benchmark_set_table.py: no plan_*.json in {out}; run "
                 f"benchmarks/benchmark_set.sh {out} first")
    print("| workload | chosen plan | pred / sim ms | pred / compiled GiB | XLA ms | GEMM share | "
          "top 5 within both | Spearman | FSDP-only sim ms | contract |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        print(row(p))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/benchmark_set"))
