"""Compile one train step (or one transformer layer, forward and backward) for a target, and
report what the compiled program does: collectives, overlap, memory, FLOPs, simulated time."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from oases_jax import registry
from oases_jax.mesh import make_mesh
from oases_jax.pipeline import registry as pipelines
from oases_jax.targets import Target
from oases_jax.tools.analysis import fusions, moe_program, pipeline_time
from oases_jax.tools.analysis import memory_report as memory_reports
from oases_jax.tools.analysis.attention import attention_kernel
from oases_jax.tools.analysis.program import Analysis, Program, analyze
from oases_jax.tools.analysis.simulate import SimResult, simulate
from oases_jax.tools.analysis.xla_compile import compile_with_estimate
from oases_jax.tools.analysis.xla_estimate import XlaEstimate
from oases_jax.training.program import CompileSpec, lower, schedule_profile_options

MEMORY_REPORT_TOP = 50  # allocations a report's JSON keeps


@dataclasses.dataclass
class Inspection:
    spec: CompileSpec
    target: Target
    analysis: Analysis
    program: Program
    sim: SimResult
    compile_s: float
    mesh: str  # resolved, e.g. data=1,tensor=8
    xla: XlaEstimate | None = None  # XLA's own estimate (GPU targets only)
    options: dict = dataclasses.field(default_factory=dict)  # the XLA options it compiled with
    pipeline: dict | None = None  # a pipelined program's tick-by-tick time (`pipeline_time`)
    # XLA's memory-usage report of the same compile (`inspect_program(memory_report=True)`)
    memory_report: memory_reports.MemoryReport | None = None
    schedule_costs: str = "xla"  # whose costs ordered it: "xla", "simulated", "profile"
    xla_scheduled_step_s: float | None = None  # under "simulated": the program XLA ordered

    def report(self) -> dict:
        a, sim, par = self.analysis, self.sim, self.spec.parallel
        return {
            "target": self.target.name,
            "cluster": self.target.cluster.name,
            "model": dataclasses.asdict(self.spec.model),
            "mesh": self.mesh,
            "rules": self.spec.parallel.rules_name,
            "schedule": "plan" if par.layers else par.schedule,
            "pipeline_schedule": par.pipeline.schedule if par.pipeline else None,
            # A plan's per-layer strategies; None when every layer runs `schedule`.
            "layers": [dataclasses.asdict(s) for s in par.layers] if par.layers else None,
            "layer": self.spec.layer,
            "batch_size": self.spec.batch_size,
            "microbatches": self.spec.microbatches,
            "seq_len": self.spec.seq_len,
            "collectives": [c.to_json() for c in a.collectives],
            "collective_counts": a.counts_by_kind(),
            "collective_bytes": a.collective_bytes(),
            "overlap_share": a.overlap_share(),
            "gemm_overlap_share": a.overlap_share(require="gemm"),
            "gemm_overlap_share_by_kind": {
                kind: a.overlap_share(require="gemm", kinds=[kind])
                for kind in sorted(a.counts_by_kind())},
            "peak_memory_bytes": a.peak_memory_bytes,
            "memory": a.memory,
            "flops": a.flops,
            # The attention the program holds, read from its HLO: cuDNN's fused flash kernel
            # ("cudnn_flash"), score GEMMs ("materialised") or "none".
            "attention_kernel": attention_kernel(self.program.module),
            "op_counts": a.op_counts,
            "simulated_step_s": sim.step_s,
            "compute_s": sim.compute_s,
            "comm_s": sim.comm_s,
            "exposed_comm_s": sim.exposed_comm_s,
            # How much of each collective's simulated time compute on the other stream covers
            # (a GEMM beside a collective is not the same as hidden), and the step's exposed
            # share (`SimResult.covered`).
            "hidden": {k: v for k, v in sim.to_json().items() if k in (
                "covered_comm_s", "hidden_share", "exposed_share", "covered_by_kind",
                "collectives")},
            "compile_s": self.compile_s,
            "compiler_options": self.options,
            "schedule_costs": self.schedule_costs,
            "xla_scheduled_step_s": self.xla_scheduled_step_s,
            "xla_estimate": self.xla.to_json() if self.xla else None,
            "moe_schedule": par.moe_schedule if self.spec.model.moe else None,
            "moe_chunks": par.moe_chunks if self.spec.model.moe else None,
            # MoE collectives by kind and axis, parm_s2's chunk overlap (`analysis.moe_program`).
            "moe": (moe_program.report(self.program, self.spec.model.n_moe_layers)
                    if self.spec.model.moe else None),
            # Where the compute time goes outside the GEMMs (`oases_jax.tools.analysis.fusions`).
            "fusions": fusions.summarize(
                fusions.account(self.program, self.target.cluster.device_spec)),
            # Pipelined programs: the tick loop priced per branch and stage (the simulated step
            # above replays each tick's conditional by its first branch).
            "pipeline": self.pipeline,
            # XLA's memory-usage report, its largest allocations (`--memory-report`).
            "memory_report": (self.memory_report.to_json(MEMORY_REPORT_TOP)
                              if self.memory_report else None),
        }


def inspect_isolated(spec: CompileSpec, target: str, timeline: str | None = None,
                     timeout_s: int = 900) -> dict:
    """`inspect_program` in a child process, returning its report. XLA aborts the whole process
    on some graphs (`ScheduleSpec.may_abort`); here that becomes a report with an `error`."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = pathlib.Path(tmp, "spec.json"), pathlib.Path(tmp, "report.json")
        spec_path.write_text(json.dumps(spec.to_json()))
        cmd = [sys.executable, "-m", "oases_jax.tools.inspection", str(spec_path), target,
               str(out_path), timeline or ""]
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode == 0 and out_path.exists():
            return json.loads(out_path.read_text())
    lines = proc.stderr.strip().splitlines()
    if proc.returncode < 0:  # killed by a signal: XLA's CHECK failures abort the process
        reason = next((ln for ln in lines if "Check failed" in ln), f"signal {-proc.returncode}")
        error = f"XLA aborted the compile: {reason.strip()[:300]}"
    else:  # a Python error in compiling or analysing: its last line says what
        error = f"inspection failed: {(lines[-1] if lines else f'exit {proc.returncode}')[:300]}"
    return {"schedule": "plan" if spec.parallel.layers else spec.parallel.schedule,
            "target": target, "error": error}


def may_abort(spec: CompileSpec) -> bool:
    """XLA may abort this program's compile (`ScheduleSpec.may_abort`): compile it in a child."""
    return any(registry.get(s).may_abort for s in spec.parallel.schedules)


SCHEDULE_COSTS = ("xla", "simulated")  # whose costs XLA's GPU scheduler orders the program by


def inspect_program(spec: CompileSpec, target: Target, *, memory_report: bool = False,
                    schedule_costs: str = "xla", schedule_profile: str | None = None,
                    write_profile: str | None = None) -> Inspection:
    """Compile `spec` for `target` through the compile path training uses
    (`training.program.lower`), and analyse and simulate the compiled program. `memory_report`:
    the same compile also dumps XLA's memory-usage report (`Inspection.memory_report`).

    XLA's GPU scheduler orders the program by its own cost model (`schedule_costs="xla"`), by a
    profile file (`schedule_profile`, `tools.analysis.schedule_profile`), or by our simulator's
    costs (`"simulated"`: compile, price every instruction, compile again with that profile;
    the report keeps the first program's simulated step as `xla_scheduled_step_s`).
    `write_profile`: where the profile of our costs goes (the one the second compile read
    under "simulated", else the inspected program's), for `train.py --schedule-profile`."""
    if schedule_costs not in SCHEDULE_COSTS:
        raise ValueError(f"schedule_costs {schedule_costs!r}: one of {SCHEDULE_COSTS}")
    if schedule_costs == "simulated":
        if schedule_profile:
            raise ValueError("schedule_costs='simulated' writes its own profile")
        first = inspect_program(spec, target)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_profile or str(pathlib.Path(tmp) / "schedule_profile.pbtxt")
            _write_profile(first, path)
            ins = inspect_program(spec, target, memory_report=memory_report,
                                  schedule_profile=path)
        ins.schedule_costs, ins.xla_scheduled_step_s = "simulated", first.sim.step_s
        return ins
    mesh = make_mesh(spec.parallel.mesh, target.devices)
    t0 = time.perf_counter()
    prog = lower(spec, mesh)
    options = {**prog.options, **schedule_profile_options(schedule_profile)}
    xla, reports = None, []
    extra = memory_reports.DUMP_OPTIONS if memory_report else {}
    if target.is_gpu_aot:  # the same compile also dumps XLA's schedule and its time estimates
        compiled, xla = compile_with_estimate(
            prog.lowered, {**options, **extra}, device=target.cluster.device_spec,
            on_dump=(lambda where: reports.append(memory_reports.read(where)))
            if memory_report else None)
    elif memory_report:
        with memory_reports.memory_dump() as (dump, where):
            compiled = prog.compile({**options, **dump})
            reports.append(memory_reports.read(where))
    else:
        compiled = prog.compile(options)
    compile_s = time.perf_counter() - t0
    analysis, program = analyze(compiled, mesh)
    sim = simulate(program, target.cluster)
    ins = Inspection(spec, target, analysis, program, sim, compile_s, prog.resolved_mesh, xla,
                     options=options,
                     pipeline=_pipeline(spec, mesh, program, target, analysis.peak_memory_bytes),
                     memory_report=reports[0] if reports else None)
    if schedule_profile:
        ins.schedule_costs = "profile"
    if write_profile:
        _write_profile(ins, write_profile)
    return ins


def _write_profile(ins: Inspection, path: str) -> None:
    from oases_jax.cli import write_atomic
    from oases_jax.tools.analysis.schedule_profile import instruction_costs, profile_text

    write_atomic(path, profile_text(instruction_costs(ins.program, ins.target.cluster)))


def _pipeline(spec: CompileSpec, mesh, program: Program, target: Target,
              peak_bytes: int) -> dict | None:
    """A pipelined train step's tick loop timed by `analysis.pipeline_time` (None otherwise)."""
    if (not spec.parallel.pipeline or spec.layer
            or pipelines.get(spec.parallel.pipeline.schedule).executor != "ticks"):
        return None  # no tick switch (gpipe_spmd, 1f1b_spmd): the whole program is the step
    from oases_jax.training.pipeline_step import spec_for, step_plan

    plan = step_plan(spec.model, spec_for(spec.model, spec.parallel, spec.microbatches, mesh))
    timed = pipeline_time.pipeline_time(program, target.cluster, plan)
    if timed is None:
        return {"error": "no tick loop matching the plan found"}
    from oases_jax.tools.analysis.pipeline_plot import timeline_json
    from oases_jax.tools.pipeline_report import stage_account

    # Per tick and stage what ran (the --timeline picture), and per stage its FLOPs (recompute
    # included) and the activation memory its slots hold.
    return {**timed.to_json(), **timeline_json(timed),
            "per_stage": stage_account(spec, mesh, program, peak_bytes)}


if __name__ == "__main__":  # the child of `inspect_isolated`
    from oases_jax.targets import get_target

    spec_file, target_name, out_file, timeline_file = sys.argv[1:5]
    ins = inspect_program(CompileSpec.from_json(json.loads(pathlib.Path(spec_file).read_text())),
                          get_target(target_name))
    pathlib.Path(out_file).write_text(json.dumps(ins.report()))
    if timeline_file:
        from oases_jax.tools.report import draw_timeline

        draw_timeline(ins.sim.events, ins.report(), timeline_file)
