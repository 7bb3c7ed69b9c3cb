"""Time real train steps of several mesh/rules/schedule variants, interleaved in one run.
`python scripts/bench.py` times every schedule on data=2,tensor=4 with the `small` model.

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import json
import shlex
import sys

from oases_jax.cli import Parser, add_runtime_flags, init_runtime, run_main, write_atomic
from training.flags import add_model_flags, model_from_flags


def parse_args(argv=None):
    p = Parser(prog="bench.py", description=__doc__.splitlines()[0])
    add_model_flags(p)
    g = p.add_argument_group("variants")
    g.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="[LABEL:]MESH[/RULES[/SCHEDULE]]",
        help="a variant, e.g. data=2,tensor=4/tp/megatron (repeatable; the first is the baseline)",
    )
    g.add_argument(
        "--schedules",
        metavar="A,B,...",
        help="one variant per schedule on --mesh/--rules (default: all, if no --variant)",
    )
    g.add_argument("--mesh", default="data=2,tensor=4", help="mesh for --schedules")
    g.add_argument("--rules", default="tp", help="rule set for --schedules and --variant")
    g = p.add_argument_group("measurement")
    g.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    g.add_argument("--rounds", type=int, default=10, help="round-robin rounds")
    g.add_argument("--steps-per-round", type=int, default=2, help="steps per variant per round")
    g.add_argument("--seed", type=int, default=0, help="seed of the parameters and batches")
    g.add_argument("--data", default="stdlib", help="stdlib, a text file or dir, or a .bin")
    g.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    add_runtime_flags(p)
    return p.parse_args(argv)


def build_config(args):
    from training.bench import BenchConfig, parse_variant
    from training.config import SCHEDULES

    model = model_from_flags(args)
    variants = [parse_variant(v, rules=args.rules) for v in args.variant]
    if args.schedules is not None or not variants:
        # primepar needs a tp_row x tp_col square: give it as a --variant with such a mesh.
        default = [s for s in SCHEDULES if s != "primepar"]
        schedules = args.schedules.split(",") if args.schedules is not None else default
        variants += [
            parse_variant(f"{args.mesh}/{args.rules}/{s.strip()}", rules=args.rules)
            for s in schedules
        ]
    return BenchConfig(
        model=model,
        model_name=args.model,
        variants=tuple(variants),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        warmup=args.warmup,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        seed=args.seed,
        data=args.data,
    )


def main() -> int:
    args = parse_args()
    init_runtime(args)
    cfg = build_config(args)
    import jax

    from training.bench import format_table, run_bench

    main_process = jax.process_index() == 0

    def log(msg: str) -> None:
        if main_process:
            print(msg, file=sys.stderr, flush=True)

    report = run_bench(cfg, log)
    if main_process:
        print(format_table(report))
        if args.json:
            report["command"] = shlex.join(["python", *sys.argv])
            write_atomic(args.json, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
