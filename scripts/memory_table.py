"""Per-device peak memory of whole train steps, schedules side by side, compiled for GPU targets:
`python scripts/memory_table.py --json benchmarks/results/primepar_memory.json`; with
`--pipeline 1f1b --mesh data=2,stage=4`, per-stage memory of a pipelined step without remat,
with uniform full remat and with Merak's stage-aware ratios (`tools.pipeline_report`).

Each (model, target, schedule, mesh) is compiled in a child process (`inspect_isolated`; local
targets in this process), so the memory of one compile is returned before the next. Every flag
is documented in docs/cli.md.
"""

from __future__ import annotations

import json
import pathlib

from oases_jax import provenance
from oases_jax.cli import Parser, add_runtime_flags, init_runtime, run_main, write_atomic

# (model, overrides) and (target, [(schedule, mesh), ...]): the first schedule is the baseline.
MODELS = {"gpt2-1.5b": ("n_heads=32", "head_dim=50"), "llama2-7b": ()}
RUNS = {
    "h100:4": [("megatron", "tensor=4"), ("primepar", "tp_row=2,tp_col=2")],
    "h100:16": [("megatron", "tensor=16"), ("primepar", "tp_row=4,tp_col=4"),
                ("megatron", "data=4,tensor=4"), ("primepar", "data=4,tp_row=2,tp_col=2")],
}


def parse_args(argv=None):
    p = Parser(prog="memory_table.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", help=f"presets, comma-separated (default {','.join(MODELS)}; "
                   "with --pipeline small)")
    p.add_argument("--targets", help=f"targets, comma-separated (default {','.join(RUNS)}; "
                   "with --pipeline local)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--remat", default="none", help="remat policy of every run")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int,
                   help="tokens per sequence (default 1024, or the model's max_seq_len if less)")
    p.add_argument("--json", metavar="OUT", help="write the rows as JSON (and OUT .txt: table)")
    g = p.add_argument_group("pipelined steps (--pipeline)")
    g.add_argument("--pipeline", metavar="A,B", help="pipeline schedules: per-stage memory of "
                   "each without remat, with uniform full remat and with Merak's ratios")
    g.add_argument("--mesh", default="data=2,stage=4", help="mesh of the pipelined steps")
    g.add_argument("--r0", default="0.8", help="the first stage's recompute ratio (Merak's "
                   "rule for the others), or one ratio per stage")
    g.add_argument("--microbatches", type=int, default=8)
    g.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="model override of every pipelined run (repeatable), e.g. n_layers=40")
    add_runtime_flags(p)
    return p.parse_args(argv)


def table(rows: list[dict]) -> str:
    head = (f"{'model':<10} {'target':<8} {'schedule':<9} {'mesh':<24} {'peak GiB':>9} "
            f"{'vs megatron':>11}")
    lines = [head]
    for r in rows:
        peak = "failed" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**30:9.2f}"
        ratio = f"{r['ratio']:11.2f}" if r.get("ratio") is not None else f"{'':>11}"
        lines.append(f"{r['model']:<10} {r['target']:<8} {r['schedule']:<9} {r['mesh']:<24} "
                     f"{peak:>9} {ratio}")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    init_runtime(args)
    if args.pipeline:
        return pipeline_main(args)
    args.models = args.models or ",".join(MODELS)
    args.targets = args.targets or ",".join(RUNS)
    from oases_jax.errors import UserError
    from oases_jax.models.presets import get_preset

    unknown = [t for t in args.targets.split(",") if t not in RUNS]
    if unknown:  # before the first compile
        raise UserError(f"--targets {unknown[0]!r} has no table of runs; choose among "
                        f"{', '.join(RUNS)} (or pass --pipeline for any target)")
    for name in args.models.split(","):
        get_preset(name)
    from oases_jax.tools.inspection import inspect_isolated
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

    rows = []
    for name in args.models.split(","):
        model = get_preset(name).with_overrides(list(MODELS.get(name, ())))
        model = model.replace(dtype=args.dtype, remat=args.remat)
        seq_len = args.seq_len or min(model.max_seq_len, 1024)
        for target in args.targets.split(","):
            baseline = {}
            for schedule, mesh in RUNS[target]:
                spec = CompileSpec(model=model, batch_size=args.batch_size, seq_len=seq_len,
                                   parallel=ParallelConfig(mesh=mesh, schedule=schedule))
                rep = inspect_isolated(spec, target, timeout_s=3000)
                peak = rep.get("peak_memory_bytes")
                row = {"model": name, "target": target, "schedule": schedule, "mesh": mesh,
                       "peak_bytes": peak, "memory": rep.get("memory"), "error": rep.get("error")}
                width = mesh.split(",")[0]  # the baseline with the same data axis
                if schedule == "megatron":
                    baseline[width.startswith("data")] = peak
                ref = baseline.get(width.startswith("data"))
                row["ratio"] = peak / ref if peak and ref and schedule != "megatron" else None
                rows.append(row)
                print(table([row]).splitlines()[1], flush=True)
    text = table(rows)
    print("\n" + text)
    if args.json:
        meta = {**provenance.record(), "batch_size": args.batch_size, "seq_len": seq_len,
                "dtype": args.dtype, "remat": args.remat}
        write_atomic(args.json, json.dumps({**meta, "rows": rows}, indent=1))
        write_atomic(str(pathlib.Path(args.json).with_suffix(".txt")),
                     f"{provenance.header()}\n\n{text}\n")
    return 0


def pipeline_main(args) -> int:
    """Per-stage memory of pipelined steps (`tools.pipeline_report.memory_rows`)."""
    from oases_jax.errors import UserError
    from oases_jax.mesh import make_mesh
    from oases_jax.models.presets import get_preset
    from oases_jax.pipeline.config import PipelineConfig
    from oases_jax.targets import get_target
    from oases_jax.tools.inspection import inspect_isolated, inspect_program
    from oases_jax.tools.pipeline_report import memory_rows, memory_text, step_plan
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

    variants = (("no remat", "none", None), ("uniform full remat", "full", None),
                (f"Merak's ratios r0={args.r0}", "none", args.r0))
    runs = []  # every run built and its pipeline checked before the first compile
    for name in (args.models or "small").split(","):
        model = get_preset(name).with_overrides(args.model_set).replace(dtype=args.dtype)
        for target in (args.targets or "local").split(","):
            devices = get_target(target).devices
            for schedule in args.pipeline.split(","):
                for label, remat, ratios in variants:
                    spec = CompileSpec(model=model.replace(remat=remat),
                                       batch_size=args.batch_size,
                                       seq_len=args.seq_len or min(model.max_seq_len, 1024),
                                       microbatches=args.microbatches,
                                       parallel=ParallelConfig(
                                           mesh=args.mesh, pipeline=PipelineConfig.from_flags(
                                               pipeline=schedule, remat_ratios=ratios)))
                    step_plan(spec, make_mesh(args.mesh, devices))
                    runs.append((name, target, f"{label}, {schedule}", spec))
    rows = []
    for name, target, label, spec in runs:
        if target == "local":
            rep = inspect_program(spec, get_target(target)).report()
        else:
            rep = inspect_isolated(spec, target, timeout_s=3000)
        if "error" in rep:
            raise UserError(f"{label} on {target}: {rep['error']}")
        new = memory_rows(rep, variant=label, model=name)
        print(memory_text(new), flush=True)
        rows += new
    text = memory_text(rows)
    print("\n" + text)
    if args.json:
        write_atomic(args.json, json.dumps({**provenance.record(), "rows": rows}, indent=1))
        write_atomic(str(pathlib.Path(args.json).with_suffix(".txt")),
                     f"{provenance.header()}\n\n{text}\n")
    return 0


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    run_main(main)


if __name__ == "__main__":
    cli()
