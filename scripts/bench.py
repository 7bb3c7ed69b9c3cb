"""Time real train steps of several mesh/rules/schedule variants, interleaved in one run.
`python scripts/bench.py` times every schedule on data=2,tensor=4 with the `small` model;
`--pipeline gpipe,1f1b --mesh data=2,stage=4 --microbatches 8` pipeline schedules side by side.

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import json
import sys

from oases_jax import provenance, registry
from oases_jax.cli import Parser, add_runtime_flags, init_runtime, run_main, write_atomic
from oases_jax.pipeline import registry as pipeline_registry
from oases_jax.training.flags import add_model_flags, model_from_flags


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
        help=f"one variant per schedule on --mesh/--rules, of {', '.join(registry.SCHEDULES)} "
        "(default: all but the square ones, if no --variant)",
    )
    g.add_argument("--mesh", default="data=2,tensor=4", help="mesh for --schedules and --pipeline")
    g.add_argument("--rules", default="tp", help="rule set for --schedules and --variant")
    g.add_argument("--pipeline", metavar="A,B,...",
                   help="one variant per pipeline schedule "
                        f"({', '.join(pipeline_registry.names(runnable=True))}) on --mesh, "
                        "which needs a stage axis, and per tensor-parallel schedule inside its "
                        "stages: megatron, or each --schedules names")
    g.add_argument("--microbatches", type=int, default=1,
                   help="micro-batches per step, for every variant (pipelined ones run them "
                        "through the stages, the others accumulate gradients)")
    g.add_argument("--stage-layers", help="pipelined variants: layers per stage (default uniform)")
    g.add_argument("--virtual-stages", type=int, default=0,
                   help="pipelined variants: interleaved's chunks per stage (default 2)")
    g.add_argument("--remat-ratios", help="pipelined variants: stage-aware recompute ratios")
    g.add_argument("--fused-ticks", default="auto", metavar="A,B,...",
                   help="pipelined variants: tick tables, each of auto, on, off (e.g. on,off: "
                        "every pipeline fused and unfused side by side; default auto)")
    g.add_argument("--plan", action="append", default=[], metavar="FILE",
                   help="a variant that runs a plan JSON from scripts/plan.py (repeatable): its "
                        "mesh, layer strategies, pipeline section and micro-batches; its "
                        "global batch and sequence length must be --batch-size and --seq-len")
    g = p.add_argument_group("measurement")
    g.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    g.add_argument("--rounds", type=int, default=10, help="round-robin rounds")
    g.add_argument("--steps-per-round", type=int, default=2, help="steps per variant per round")
    g.add_argument("--seed", type=int, default=0, help="seed of the parameters and batches")
    g.add_argument("--data", default="stdlib", help="stdlib, a text file or dir, or a .bin")
    g.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    g.add_argument("--op-times", type=int, default=0, metavar="STEPS",
                   help="after timing, profile STEPS more steps per variant and print the "
                        "measured time of each op category beside its roofline price (the "
                        "per-op account of inspect_hlo.py --fusions); 0: off")
    g.add_argument("--trace-dir", metavar="DIR",
                   help="keep each variant's --op-times profiler trace under DIR/LABEL (a "
                        "Perfetto trace, also readable by TensorBoard); default: discarded")
    g = p.add_argument_group("planner")
    g.add_argument("--predict", metavar="SOURCE",
                   help="also price every variant with the planner's cost model (datasheet, "
                        "profile or xla costs) and report both rankings and their Spearman "
                        "correlation")
    g.add_argument("--profile", help="calibration profile for --predict profile|xla (default: "
                                     "planner/profiles/DEVICE-N.json)")
    add_runtime_flags(p)
    return p.parse_args(argv)


def build_config(args):
    from oases_jax.errors import UserError
    from oases_jax.files import output_file
    from oases_jax.pipeline.config import FUSED_TICKS, PipelineConfig
    from oases_jax.tools.bench import BenchConfig, VariantSpec, parse_variant
    from oases_jax.training.config import check_seed
    from oases_jax.training.data import data_files

    check_seed(args.seed)
    if args.trace_dir and not args.op_times:
        raise UserError(f"--trace-dir {args.trace_dir} keeps the --op-times profiles: add "
                        f"--op-times 2 (steps to profile per variant)")
    data_files(args.data)  # missing, empty, a FIFO or a device: now, not after the compiles
    if args.json:
        output_file(args.json, "--json")
    model = model_from_flags(args)
    variants = [parse_variant(v, rules=args.rules) for v in args.variant]
    variants += [plan_variant(path, model, args) for path in args.plan]
    pipelines = [p.strip() for p in args.pipeline.split(",")] if args.pipeline else []
    if pipelines:
        # Every pipeline schedule with every tensor-parallel schedule inside its stages
        # (e.g. --pipeline gpipe_spmd --schedules megatron,collective_matmul).
        schedules = args.schedules.split(",") if args.schedules else ["megatron"]
        fused = [f.strip() for f in args.fused_ticks.split(",")]
        bad = [f for f in fused if f not in FUSED_TICKS]
        if bad:
            raise UserError(f"unknown --fused-ticks {bad[0]!r}: give auto, on or off (or a "
                            f"comma list of them)")
        variants += [VariantSpec(mesh=args.mesh, rules=args.rules, schedule=s.strip(),
                                 pipeline=PipelineConfig.from_flags(
                                     pipeline=p, stage_layers=args.stage_layers,
                                     virtual_stages=args.virtual_stages,
                                     remat_ratios=args.remat_ratios, fused_ticks=f))
                     for p in pipelines for s in schedules for f in fused]
    elif args.schedules is not None or not variants:
        # primepar needs a tp_row x tp_col square: give it as a --variant with such a mesh.
        default = list(registry.names(square=False))
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
        microbatches=args.microbatches,
        op_times=args.op_times,
        trace_dir=args.trace_dir,
    )


def plan_variant(path: str, model, args):
    """A variant from a plan file: its whole parallel config, micro-batches and predicted step,
    labelled by the file's name; the plan must be for this model, batch and sequence length."""
    import pathlib

    from oases_jax.errors import UserError
    from oases_jax.planner import plan as plans
    from oases_jax.tools.bench import VariantSpec

    plan = plans.load(path)
    plan.check_model(model)
    for name, got, want in (("global batch", plan.global_batch, args.batch_size),
                            ("sequence length", plan.seq_len, args.seq_len)):
        if got != want:
            flag = "--batch-size" if name == "global batch" else "--seq-len"
            raise UserError(f"plan {path!r} is for a {name} of {got}, not {want}: pass "
                            f"{flag} {got} or plan again")
    par = plan.parallel()
    return VariantSpec(mesh=par.mesh, rules=par.rules, schedule=par.schedule,
                       label=pathlib.Path(path).stem, pipeline=par.pipeline, parallel=par,
                       microbatches=plan.microbatches,
                       predicted_s=plan.raw.get("predicted_step_s"))


def add_predictions(report: dict, cfg, hw, source: str) -> None:
    """Put the planner's predicted step time beside every measured variant, and the rank
    correlation of the two over the variants it prices."""
    from oases_jax.planner.verification.rank import (
        predict_pipeline_step_s,
        predict_step_s,
        spearman,
    )

    rows = report["variants"]
    for r, variant in zip(rows, cfg.variants, strict=True):
        if r.get("plan_predicted_s") is not None:  # a plan variant: the plan's own prediction
            r["predicted_s"] = r["plan_predicted_s"]
            continue
        if variant.pipeline:  # priced as the 3D search prices its plans
            r["predicted_s"] = predict_pipeline_step_s(
                cfg.model, hw, mesh=r["mesh"], rules=r["rules"], schedule=r["schedule"],
                pipeline=variant.pipeline,
                microbatches=r.get("microbatches") or cfg.microbatches,
                global_batch=cfg.batch_size, seq_len=cfg.seq_len)
            continue
        r["predicted_s"] = predict_step_s(
            cfg.model, hw, mesh=r["mesh"], rules=r["rules"], schedule=r["schedule"],
            sub_batches=r.get("sub_batches", 2), global_batch=cfg.batch_size,
            seq_len=cfg.seq_len, microbatches=r.get("microbatches") or 1)
    priced = [r for r in rows if r["predicted_s"] is not None]
    rho = spearman([r["predicted_s"] for r in priced], [r["median_s"] for r in priced]) \
        if len(priced) >= 2 else None
    report["prediction"] = {"cost_source": source, "cluster": hw.cluster.name,
                            "profile": getattr(hw.profile, "meta", {}).get("command"),
                            "variants": len(priced), "spearman": rho}


def format_predictions(report: dict) -> str:
    from oases_jax.planner.verification.rank import ranks

    rows = [r for r in report["variants"] if r.get("predicted_s") is not None]
    pred = report["prediction"]
    if not rows:
        return "the planner prices none of these variants (xla_auto and other axes are unmodelled)"
    meas_rank = ranks([r["median_s"] for r in rows])
    pred_rank = ranks([r["predicted_s"] for r in rows])
    width = max(len(r["label"]) for r in rows)
    lines = [f"planner ({pred['cost_source']} costs, {pred['cluster']}) against the measurement:",
             f"{'variant':<{width}}  {'measured ms':>11}  {'rank':>4}  {'predicted ms':>12}  "
             f"{'rank':>4}"]
    for r, mr, pr in zip(rows, meas_rank, pred_rank, strict=True):
        lines.append(f"{r['label']:<{width}}  {r['median_s'] * 1e3:11.2f}  {mr:4g}  "
                     f"{r['predicted_s'] * 1e3:12.2f}  {pr:4g}")
    rho = pred["spearman"]
    lines.append(f"Spearman rank correlation over {len(rows)} variants: "
                 + ("-" if rho is None else f"{rho:.3f}"))
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    init_runtime(args)
    cfg = build_config(args)
    import jax

    hw = None
    if args.predict is not None:  # load the costs first: a bad source fails before compiling
        from oases_jax.planner import load_profile, local_cluster
        from oases_jax.planner.cost.prices import Hardware

        cluster = local_cluster()
        hw = Hardware.of(cluster, load_profile(args.predict, cluster, args.profile))

    from oases_jax.tools.bench import format_table, run_bench

    main_process = jax.process_index() == 0

    def log(msg: str) -> None:
        if main_process:
            print(msg, file=sys.stderr, flush=True)

    report = run_bench(cfg, log)
    if hw is not None:
        add_predictions(report, cfg, hw, args.predict)
    if main_process:
        print(format_table(report))
        if hw is not None:
            print(format_predictions(report))
        if cfg.op_times:
            from oases_jax.tools.op_times import format_table as op_table

            for r in report["variants"]:
                print(op_table(r["label"], r["op_times"]))
        if args.json:
            report.update(provenance.record())
            write_atomic(args.json, json.dumps(report, indent=1) + "\n")
    return 0


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    run_main(main)


if __name__ == "__main__":
    cli()
