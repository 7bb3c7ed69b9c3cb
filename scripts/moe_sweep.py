"""Price Parm's MoE schedules over the WORKLOADS grid of MoE layers (E, hidden, tokens per
device, top-k, capacity factor) on one 8-H100 node and a 32-GPU cluster of 8 nodes x 4, with
the alpha-beta model; report each schedule's time, the auto choice and its speedup over ds_moe.
`python scripts/moe_sweep.py --out benchmarks/results/moe_sweep.json`

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import json

from oases_jax.cli import Parser, run_main, write_atomic


def parse_args(argv=None):
    p = Parser(prog="moe_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write every row as JSON here")
    p.add_argument("--dtype-bytes", type=int, default=2, choices=(2, 4),
                   help="bytes per activation element (default 2: bf16)")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    from planner.moe_cost import markdown, summary, sweep

    rows = sweep(dtype_bytes=args.dtype_bytes)
    print(markdown(rows))
    if args.out:
        write_atomic(args.out, json.dumps({"summary": summary(rows), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    run_main(main)
