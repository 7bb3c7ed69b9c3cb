"""Our simulator's costs handed to XLA's GPU scheduler: a profile in the format of XLA's
profile-guided latency estimator (`ProfiledInstructionsProto`, text), one entry per instruction
of a compiled program with the seconds `simulate` prices it at, so that a second compile of the
same program orders its work by those costs instead of XLA's own cost model (which, on the
overlapped schedules, prices one GEMM above an all-reduce and leaves collectives with nothing
beside them).

    costs { name: "all-gather-start.2" cost_us: 30.8 }

A collective is entered under its async start's name and under the name without `-start` (the
collective XLA converts to the start/done pair during scheduling). Instructions the second
compile names differently fall back to XLA's estimate (the scheduler warns of them).

The compile option that reads it is `training.program.SCHEDULE_PROFILE_OPTION`;
`tools.inspection.inspect_program` with
`schedule_costs="simulated"` compiles, writes the profile and compiles again, and
`train.py --schedule-profile` trains the program compiled with a profile written by
`inspect_hlo.py --write-schedule-profile` (docs/inspection.md)."""

from __future__ import annotations

from oases_jax.hardware import ClusterSpec
from oases_jax.tools.analysis.program import TRIVIAL, Program, collective_kind, is_async_start
from oases_jax.tools.analysis.simulate import Simulator


def instruction_costs(program: Program, cluster: ClusterSpec) -> dict[str, float]:
    """Seconds of every instruction of every computation that costs any: collectives by the
    alpha-beta model (async starts and synchronous ones), the rest by the roofline."""
    sim = Simulator(program, cluster)
    out: dict[str, float] = {}
    for comp in program.module.computations.values():
        for idx, instr in enumerate(comp.instrs):
            if instr.opcode in TRIVIAL or instr.opcode.endswith("-done"):
                continue
            kind = collective_kind(instr, program.module)
            if kind and (is_async_start(instr) or not instr.opcode.endswith("-start")):
                seconds = sim.comm_time(comp, idx, instr, kind)
            elif kind or instr.opcode in ("while", "call", "conditional"):
                continue
            else:
                seconds = sim.compute_time(comp, instr)
            if seconds > 0:
                out[instr.name] = seconds
    return out


def profile_text(costs: dict[str, float]) -> str:
    """`ProfiledInstructionsProto` in text form, costs in microseconds."""
    lines = []
    for name, seconds in sorted(costs.items()):
        names = [name] + ([name.replace("-start", "", 1)] if "-start" in name else [])
        lines += [f'costs {{ name: "{n}" cost_us: {seconds * 1e6:.4f} }}' for n in names]
    return "\n".join(lines) + "\n"
