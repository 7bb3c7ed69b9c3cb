"""Price Parm's MoE schedules over the WORKLOADS grid of MoE layers (E, hidden, tokens per
device, top-k, capacity factor) on one 8-H100 node and a 32-GPU cluster of 8 nodes x 4, with
the alpha-beta model; report each schedule's time, the auto choice and its speedup over ds_moe.
With --compiled N, compile every schedule auto weighs for N of the layers per cluster (no GPU
needed) and check auto's pick against our simulator of the compiled programs.
`python scripts/moe_sweep.py --out benchmarks/results/moe_sweep.json`
`python scripts/moe_sweep.py --compiled 18 --out benchmarks/results/moe_sweep_compiled.json`

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import json
import sys
import time

from oases_jax import provenance
from oases_jax.cli import Parser, run_main, write_atomic


def parse_args(argv=None):
    p = Parser(prog="moe_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the summary and every row as JSON here")
    p.add_argument("--dtype-bytes", type=int, default=2, choices=(2, 4),
                   help="bytes per activation element (default 2: bf16; the model sweep only)")
    p.add_argument("--compiled", type=int, default=0, metavar="N",
                   help="compile N layers per cluster (1..108) for the clusters' GPUs and time "
                        "them with the simulator, beside the model (default 0: the model only)")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    made = provenance.record()
    if args.compiled:
        from oases_jax.planner.verification.moe_compiled import markdown, subset, summary, validate

        configs = subset(args.compiled)
        t0 = time.perf_counter()
        rows = validate(configs, log=lambda line: print(line, file=sys.stderr, flush=True))
        seconds = time.perf_counter() - t0
        print(provenance.header() + "\n")
        print(markdown(rows))
        print(f"\n{len(rows)} layers, {sum(len(r['simulated']) for r in rows)} programs "
              f"compiled in {seconds:.0f} s")
        out = {**made, "seconds": seconds, "summary": summary(rows), "rows": rows}
    else:
        from oases_jax.planner.cost.moe_cost import markdown, summary, sweep

        rows = sweep(dtype_bytes=args.dtype_bytes)
        print(markdown(rows))
        out = {**made, "summary": summary(rows), "rows": rows}
    if args.out:
        write_atomic(args.out, json.dumps(out, indent=1))
    return 0


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    run_main(main)


if __name__ == "__main__":
    cli()
