"""Compile a train step (or one layer) for a target and show what XLA did: collectives, overlap,
memory, FLOPs and simulated time. `python scripts/inspect_hlo.py --model small --target h100:8`;
`--plan PLAN.json` compiles the train step a plan of scripts/plan.py describes.

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys

from oases_jax import provenance, registry
from oases_jax.cli import Parser, add_runtime_flags, init_runtime, run_main, write_atomic
from oases_jax.pipeline import registry as pipeline_registry
from oases_jax.training.flags import (
    add_layout_flags,
    add_model_flags,
    layout_kwargs,
    model_from_flags,
)

DEFAULTS = {"mesh": "tensor=-1", "rules": "tp", "schedule": "megatron", "sub_batches": 2,
            "batch_size": 8, "seq_len": None}


def parse_args(argv=None):
    p = Parser(prog="inspect_hlo.py", description=__doc__.splitlines()[0])
    add_model_flags(p)
    # None tells "not given" apart: with --plan the model comes from the plan.
    p.set_defaults(model=None)
    # Defaults of the flags a plan sets; None in the parser to tell them from a given value.
    p.add_argument("--mesh", help=f"mesh over the target's devices (default {DEFAULTS['mesh']})")
    p.add_argument("--rules", help=f"rule set (default {DEFAULTS['rules']})")
    p.add_argument("--schedule", help=f"tensor-parallel schedule: {', '.join(registry.SCHEDULES)} "
                   f"(default {DEFAULTS['schedule']})")
    p.add_argument("--sub-batches", type=int, help="oases schedules: sub-batches (default 2)")
    add_layout_flags(p)
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per step")
    p.add_argument("--plan", help="a plan JSON from scripts/plan.py: its model (unless --model "
                   "is given), mesh, rules, batch, micro-batches and per-layer strategies")
    p.add_argument("--target", default="local",
                   help="local, or GPU:N with GPU h100, h200, a100 or 3090")
    p.add_argument("--layer", action="store_true", help="one layer's forward+backward only")
    p.add_argument("--batch-size", type=int, help="global batch (default 8)")
    p.add_argument("--seq-len", type=int, help="default: the model's max_seq_len, at most 1024")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--allow-oversize", action="store_true",
                   help="a program whose peak is over the target's device memory is reported "
                        "with exit 0 (default: exit 7 after the report)")
    p.add_argument("--fusions", action="store_true",
                   help="also print the per-op account of the compute outside the GEMMs")
    p.add_argument("--memory-report", type=int, default=0, metavar="N",
                   help="also print the N largest allocations of XLA's memory-usage report "
                   "(the same compile dumps it; the JSON keeps the 50 largest)")
    p.add_argument("--op-trace", metavar="DIR",
                   help="a profiler trace of this same program run on real devices (bench.py "
                        "--op-times STEPS --trace-dir): print each op category's measured time "
                        "beside its roofline price")
    p.add_argument("--op-trace-steps", type=int, default=1, metavar="N",
                   help="steps the --op-trace holds (bench.py's --op-times STEPS; default 1)")
    p.add_argument("--timeline", metavar="OUT.png", help="draw the timeline (a pipelined step: "
                   "one row per stage, tick by tick; gpipe_spmd and 1f1b_spmd, with no tick "
                   "switch: the whole program's two streams)")
    p.add_argument("--timeline-source", choices=("sim", "xla"), default="sim",
                   help="whose timeline --timeline draws: our simulator's or XLA's estimate "
                        "(GPU targets)")
    p.add_argument("--schedule-costs", choices=("xla", "simulated"), default="xla",
                   help="whose costs XLA's GPU scheduler orders the program by: its own, or "
                        "our simulator's (compile, price, compile again; GPU targets)")
    p.add_argument("--schedule-profile", metavar="FILE",
                   help="compile with this scheduling profile (from --write-schedule-profile)")
    p.add_argument("--write-schedule-profile", metavar="OUT",
                   help="write our simulator's costs of the program as a scheduling profile, "
                        "for train.py --schedule-profile (one program)")
    p.add_argument("--compare", metavar="A,B,...", help="schedules side by side")
    p.add_argument("--diff", metavar="A,B", help="two schedules (or report .json files) compared")
    add_runtime_flags(p)
    return p.parse_args(argv)


def check_args(args) -> None:
    """Sizes, output paths and --diff's reports, before anything compiles."""
    from oases_jax.errors import UserError
    from oases_jax.files import output_file
    from oases_jax.schema import MAX_GLOBAL_BATCH, MAX_SEQ_LEN

    for flag, value, cap in (("--batch-size", args.batch_size, MAX_GLOBAL_BATCH),
                             ("--seq-len", args.seq_len, MAX_SEQ_LEN),
                             ("--sub-batches", args.sub_batches, MAX_GLOBAL_BATCH)):
        if value is not None and not 1 <= value <= cap:
            raise UserError(f"{flag} {value} must be in 1..{cap:,}")
    for flag, value in (("--json", args.json), ("--timeline", args.timeline),
                        ("--write-schedule-profile", args.write_schedule_profile)):
        if value:
            output_file(value, flag)
    check_schedule_flags(args)
    if args.diff is not None and len(args.diff.split(",")) != 2:
        raise UserError(f"--diff {args.diff!r} needs two entries, e.g. megatron,xla_auto")
    if args.op_trace is not None:
        from oases_jax.tools.op_times import find_trace

        find_trace(args.op_trace, "--op-trace")  # missing or empty: now, not after the compile
        if args.compare or args.diff or (args.pipeline and "," in args.pipeline):
            raise UserError(f"--op-trace {args.op_trace} is the trace of one program: drop "
                            f"--compare/--diff or give one --pipeline schedule")
    if args.op_trace_steps < 1:
        raise UserError(f"--op-trace-steps {args.op_trace_steps} must be >= 1")
    if not 0 <= args.memory_report <= 1000:
        raise UserError(f"--memory-report {args.memory_report} must be in 0..1000 (the number "
                        f"of allocations to print; 0: none)")


def check_schedule_flags(args) -> None:
    """--schedule-costs, --schedule-profile and --write-schedule-profile: GPU targets only, a
    profile that exists, one program where one is written."""
    from oases_jax.errors import UserError
    from oases_jax.training.program import check_schedule_profile

    if (args.schedule_costs == "simulated" or args.schedule_profile) and args.target == "local":
        raise UserError("--schedule-costs simulated / --schedule-profile order the program for "
                        "XLA's GPU scheduler: give a GPU --target (e.g. h100:8)")
    if args.schedule_profile:
        check_schedule_profile(args.schedule_profile)
        if args.schedule_costs == "simulated":
            raise UserError("--schedule-profile FILE and --schedule-costs simulated both set "
                            "the scheduler's costs: give one")
    if args.write_schedule_profile and (args.compare or args.diff
                                        or (args.pipeline and "," in args.pipeline)):
        raise UserError(f"--write-schedule-profile {args.write_schedule_profile} is the profile "
                        f"of one program: drop --compare/--diff or give one --pipeline schedule")


def main() -> int:
    args = parse_args()
    check_args(args)
    if args.target != "local" and not os.environ.get("JAX_PLATFORMS"):
        # Compiling for GPUs that are not here: keep the local backend on the CPU.
        import jax

        jax.config.update("jax_platforms", "cpu")
    init_runtime(args)
    from oases_jax.errors import UserError
    from oases_jax.targets import get_target
    from oases_jax.tools import report
    from oases_jax.training.config import ParallelConfig

    if args.model is None and not args.plan:
        args.model = "small"
    model = model_from_flags(args) if args.model else None
    target = get_target(args.target)
    if args.timeline_source == "xla" and not target.is_gpu_aot:
        raise UserError(f"--timeline-source xla needs a GPU target (--target h100:8), not "
                        f"{args.target!r}: XLA's estimate comes from its GPU scheduler")
    plan = None
    if args.plan:
        plan, model = load_plan(args, model, len(target.devices))
        target = plan_cluster(plan, target)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    seq_len = plan.seq_len if plan else args.seq_len or min(model.max_seq_len, 1024)
    pipelines = args.pipeline.split(",") if args.pipeline else [None]
    if len(pipelines) > 1 and (args.compare or args.diff):
        raise UserError(f"--pipeline {args.pipeline} compares pipeline schedules; drop "
                        f"--compare/--diff (or give one pipeline schedule)")
    job = _Job(args, model, target, plan, seq_len)
    if args.diff:
        names = args.diff.split(",")
        files = {n: report.load_report(n) for n in names if n.endswith(".json")}  # before compiling
        print(report.diff(*[files[n] if n in files else job.inspect(n) for n in names]))
        return 0
    if len(pipelines) > 1:  # pipeline schedules side by side, each compiled in turn
        for p in pipelines:  # every one checked before the first compile
            ParallelConfig(mesh=args.mesh, rules=args.rules, schedule=args.schedule,
                           **layout_kwargs(args, p))
        reports = [job.inspect(args.schedule, i == 0, p) for i, p in enumerate(pipelines)]
    else:
        schedules = args.compare.split(",") if args.compare else [args.schedule]
        reports = [job.inspect(s, i == 0) for i, s in enumerate(schedules)]
    print_reports(args, reports, pipelines)
    if args.json:
        made = provenance.record()
        for r in reports:
            r.update(made)
        write_atomic(args.json, json.dumps(reports[0] if len(reports) == 1 else reports, indent=1))
    return memory_verdict(reports, target, args.allow_oversize)


EXIT_OVERSIZE = 7


def memory_verdict(reports: list[dict], target, allow: bool) -> int:
    """One line on stderr per program whose compiled peak is over the target's memory per
    device (an error: exit EXIT_OVERSIZE, unless `allow`), or, on GPU targets, over the memory
    XLA's GPU scheduler plans within (a note: its collectives were serialised)."""
    from oases_jax.planner.verification.verify import scheduler_limit_bytes

    memory, code = target.cluster.memory_per_device, 0
    shared = " (its CPU devices share the host's memory)" if target.cluster.device == "cpu" else ""
    for r in reports:
        peak = r.get("peak_memory_bytes")
        if "error" in r or peak is None:
            continue
        what = f"{r.get('schedule', 'the program')} on {r['target']}"
        if peak > memory:
            kind = "note" if allow else "error"
            print(f"inspect_hlo.py: {kind}: {what} peaks at {peak / 2**20:,.0f} MiB per device, "
                  f"over the {memory / 2**20:,.0f} MiB each device has{shared}: it does not fit; "
                  "shard more (--rules fsdp, a larger tensor degree), recompute (--remat), or "
                  "use a smaller --batch-size", file=sys.stderr)
            code = 0 if allow else EXIT_OVERSIZE
        elif target.is_gpu_aot and peak > scheduler_limit_bytes(r.get("memory") or {}, memory):
            print(f"inspect_hlo.py: note: {what} peaks at {peak / 2**20:,.0f} MiB, above the "
                  "memory XLA's GPU scheduler plans within (0.8 x device memory, less inputs "
                  "and outputs, x 0.95): it fits, with its collectives serialised",
                  file=sys.stderr)
    return code


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every compile of one invocation shares: the flags, the model, the target, the plan
    (`--plan`, else None) and the sequence length."""

    args: argparse.Namespace
    model: object
    target: object
    plan: object
    seq_len: int

    def timeline_path(self, schedule: str, first: bool) -> str | None:
        if not self.args.timeline:
            return None
        path = pathlib.Path(self.args.timeline)
        return self.args.timeline if first else str(path.with_stem(f"{path.stem}-{schedule}"))

    def spec(self, schedule: str, pipeline: str | None):
        from oases_jax.training.config import ParallelConfig
        from oases_jax.training.program import CompileSpec

        args = self.args
        if self.plan:
            return self.plan.compile_spec(self.model)
        parallel = ParallelConfig(mesh=args.mesh, rules=args.rules, schedule=schedule,
                                  sub_batches=args.sub_batches, **layout_kwargs(args, pipeline))
        return CompileSpec(model=self.model, batch_size=args.batch_size, seq_len=self.seq_len,
                           layer=args.layer, microbatches=args.microbatches, parallel=parallel)

    def inspect(self, schedule: str, first: bool = True, pipeline: str | None = None) -> dict:
        """The report of one schedule (and its timeline PNG when asked)."""
        from oases_jax.tools import report
        from oases_jax.tools.inspection import inspect_isolated, inspect_program, may_abort

        args, target = self.args, self.target
        spec = self.spec(schedule, pipeline)
        png = self.timeline_path(pipeline or schedule, first)
        xla_png = png if args.timeline_source == "xla" else None
        # A pipelined step's picture is one row per stage, tick by tick (`pipeline_plot`): the
        # two-stream replay takes each tick's conditional by its first branch. The SPMD
        # pipelines have no conditional: the whole program's two-stream replay is their step.
        ticked = (spec.parallel.pipeline is not None
                  and pipeline_registry.get(spec.parallel.pipeline.schedule).executor == "ticks")
        stage_png = png if ticked and not spec.layer and not xla_png else None
        png = None if stage_png else png
        if target.is_gpu_aot and may_abort(spec):
            r = inspect_isolated(spec, args.target, None if xla_png else png)
        else:
            ins = inspect_program(spec, target, memory_report=args.memory_report > 0,
                                  schedule_costs=args.schedule_costs,
                                  schedule_profile=args.schedule_profile,
                                  write_profile=args.write_schedule_profile)
            r = ins.report()
            if args.op_trace:
                from oases_jax.tools.op_times import traced

                r["op_times"] = traced(ins.program, target.cluster.device_spec, args.op_trace,
                                       args.op_trace_steps)
            if png and not xla_png:
                report.draw_timeline(ins.sim.events, r, png)
        if xla_png and "error" not in r:
            report.draw_timeline(None, r, xla_png, source="xla")
        if stage_png and "error" not in r:
            draw_stages(r, stage_png)
        if self.plan:
            r["plan"] = args.plan
            r["planner_predicted_step_s"] = self.plan.raw.get("predicted_step_s")
        return r


def print_reports(args, reports: list[dict], pipelines: list) -> None:
    """Each report's summary (with the fusions, op times and memory report asked for), then the
    table setting them side by side."""
    from oases_jax.tools import report

    for r in reports:
        print(report.summary(r), end="\n\n")
        if args.fusions and r.get("fusions"):
            from oases_jax.tools.analysis.fusions import format_summary

            print(format_summary(r["fusions"]), end="\n\n")
        if r.get("op_times"):
            from oases_jax.tools.op_times import format_table

            print(format_table(f"{args.op_trace} ({args.op_trace_steps} steps)", r["op_times"]),
                  end="\n\n")
        if args.memory_report and r.get("memory_report"):
            from oases_jax.tools.analysis.memory_report import MemoryReport

            print(MemoryReport.from_json(r["memory_report"]).format(args.memory_report),
                  end="\n\n")
    if len(pipelines) > 1 and all("error" not in r for r in reports):
        from oases_jax.tools.pipeline_report import schedules_table

        print(schedules_table(reports))
    elif len(reports) > 1:
        print(report.compare_table(reports))


def draw_stages(r: dict, path: str) -> None:
    """The per-stage timeline of a pipelined report (`oases_jax.tools.analysis.pipeline_plot`)."""
    from oases_jax.tools.analysis import pipeline_plot

    p = r.get("pipeline") or {"error": "the report has no pipeline block"}
    if "error" in p:
        print(f"inspect_hlo.py: no per-stage timeline: {p['error']}", file=sys.stderr)
        return
    m = r["model"]
    pipeline_plot.draw(p, path, title=f"{m['family']} d={m['d_model']} L={m['n_layers']} "
                       f"{m['dtype']} on {r['target']}, mesh {r['mesh']}, batch "
                       f"{r['batch_size']} x {r['seq_len']} (our simulator, tick by tick)")


def load_plan(args, model, n_devices: int):
    """The plan of --plan and its model, checked against the other flags and the target. The
    model is the plan's own (`Plan.model`) with --model-set, --dtype, --remat and --scan
    applied, or --model's when given; either way it must be the model the plan was made for."""
    from oases_jax.errors import UserError
    from oases_jax.mesh import parse_mesh
    from oases_jax.planner import plan as plans

    given = [f"--{k.replace('_', '-')}" for k in DEFAULTS if getattr(args, k) is not None]
    given += [f"--{k}" for k in ("compare", "diff", "layer") if getattr(args, k)]
    if given:
        raise UserError(f"--plan sets the mesh, rules, schedules, batch and sequence length; "
                        f"drop {', '.join(given)}")
    plan = plans.load(args.plan)
    source = f"--model {args.model}" if model else "--model-set/--dtype"
    if model is None:
        model = model_from_plan(args, plan.model(f"plan {args.plan!r}"))
    plan.check_model(model)
    # The plan's prediction is only comparable on the model it was made for.
    planned = plan.raw.get("model_config") or {}
    for key, value in dataclasses.asdict(model).items():
        if key not in ("remat", "scan_layers") and planned.get(key, value) != value:
            raise UserError(f"plan {args.plan!r} was made for model {plan.raw.get('model')!r} "
                            f"with {key}={planned[key]!r}, but {source} gives "
                            f"{key}={value!r}; drop --model to take the plan's, or pass the model "
                            f"the plan was made for (--model, --model-set, --dtype)")
    need = math.prod(parse_mesh(plan.mesh).shape)
    if need != n_devices:
        gpu = plan.raw.get("cluster", "h100").split("-")[0].split(":")[0]
        gpu = gpu if gpu in ("h100", "h200", "a100", "3090") else "h100"
        fix = (f"--cpu-devices {need} (or --target {gpu}:{need})" if args.target == "local"
               else f"--target {gpu}:{need}")
        raise UserError(f"plan {args.plan!r} has mesh {plan.mesh} ({need} devices) but target "
                        f"{args.target} has {n_devices}; use {fix}, or plan again for "
                        f"{n_devices} devices")
    return plan, model


def plan_cluster(plan, target):
    """The target simulated on the cluster the plan was made for, where the plan's cluster compiles
    for this target (`planner.verification.verify.compile_target`): `3090:32` is the PCIe cluster,
    and a plan for `3090-nvlink-32` is timed over its bridges, as `plan.py --verify` timed it."""
    import dataclasses as dc

    from oases_jax.errors import UserError
    from oases_jax.hardware import get_cluster
    from oases_jax.planner.verification.verify import compile_target

    name = plan.raw.get("cluster")
    if not name or name == target.cluster.name:
        return target
    try:
        cluster = get_cluster(name)
        same = compile_target(cluster) == target.name
    except UserError:  # a cluster this checkout does not know, or with no compile target
        return target
    return dc.replace(target, cluster=cluster) if same else target


def model_from_plan(args, model):
    """The plan's model with the model flags given beside it applied (as `model_from_flags`
    applies them to a preset)."""
    model = model.with_overrides(args.model_set)
    given = (("dtype", args.dtype), ("remat", args.remat), ("scan_layers", args.scan))
    return model.replace(**{k: v for k, v in given if v is not None})


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    run_main(main)


if __name__ == "__main__":
    cli()
