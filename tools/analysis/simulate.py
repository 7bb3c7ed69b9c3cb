"""Replay a compiled schedule on two streams (compute, collectives) with roofline and alpha-beta
costs, to estimate step time and how much communication stays exposed, by the project's one
two-stream engine (`oases_jax.streams`, which the planner's layer replay and the MoE cost model
use too).

Rules of the replay, in schedule order:
- compute op: runs on the compute stream, cost max(FLOPs / peak, bytes / HBM bandwidth);
- async start: the transfer begins when both the issuing point and the comm stream are free;
- async done: the compute stream waits until that transfer has finished;
- sync collective: both streams wait for each other, then run it;
- while loops replay their body `trip_count` times.
"""

from __future__ import annotations

import dataclasses

from oases_jax.hardware import ClusterSpec, DeviceSpec, collective_time
from oases_jax.streams import COMPUTE, Event, Streams, Window
from oases_jax.tools.analysis.hlo import Computation, Instr
from oases_jax.tools.analysis.program import TRIVIAL, Program, collective_kind, is_async_start

LOW_PRECISION = ("bf16", "f16", "f8e4m3fn", "f8e5m2", "s8", "u8")


def roofline_time(program: Program, comp: Computation, instr: Instr, device: DeviceSpec) -> float:
    """A compute op's time: max(FLOPs / peak, HBM bytes / bandwidth), at the bf16 peak when an
    input is 16-bit or narrower, else the fp32 one. GEMMs, fusions and cuDNN's fused attention
    alike (`Program.instr_flops`, `Program.traffic_bytes`: a flash kernel reads Q, K, V (and dO,
    O, the softmax statistics) and writes its outputs, never the scores)."""
    if instr.opcode in TRIVIAL:
        return 0.0
    flops = program.instr_flops(comp, instr)
    nbytes = program.traffic_bytes(comp, instr)
    dtype = "bfloat16" if _low_precision(comp, instr) else "float32"
    return max(flops / device.peak(dtype), nbytes / device.hbm_bytes_per_s)


def _low_precision(comp: Computation, instr: Instr) -> bool:
    operands = [comp.by_name.get(o) for o in instr.operands]
    dtypes = {a.dtype for o in operands if o for a in o.shapes} or {a.dtype for a in instr.shapes}
    return bool(dtypes & set(LOW_PRECISION))


@dataclasses.dataclass
class SimResult:
    """`covered`: per collective kind, (its simulated seconds, the seconds of them compute on
    the other stream covers). A collective with a GEMM beside it is not hidden: only the time
    compute runs inside its window is (synchronous collectives: none)."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    events: list[Event]
    covered: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    windows: list[Window] = dataclasses.field(default_factory=list)  # per collective

    @property
    def covered_comm_s(self) -> float:
        return sum(c for _, c in self.covered.values())

    @property
    def hidden_share(self) -> float:
        """The share of the collectives' simulated time compute covers."""
        return self.covered_comm_s / self.comm_s if self.comm_s else 1.0

    @property
    def exposed_share(self) -> float:
        """The share of the step that is communication nothing covers."""
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("step_s", "compute_s", "comm_s", "exposed_comm_s",
                                             "covered_comm_s", "hidden_share", "exposed_share")}
        out["covered_by_kind"] = {k: {"comm_s": s, "covered_s": c, "share": c / s if s else 1.0}
                                  for k, (s, c) in sorted(self.covered.items())}
        out["collectives"] = [{"name": w.name, "kind": w.kind, "start_s": w.start,
                               "end_s": w.end, "covered_s": w.covered_s, "share": w.share}
                              for w in self.windows]
        return out


class Simulator:
    """`compute_cost(comp, instr)` and `comm_cost(comp, idx, instr, kind)` may replace the roofline
    and alpha-beta costs (tests use hand-chosen costs). Instructions named in `skip` replay as
    nothing (`replay` prices one computation without, say, the loop or conditional inside it)."""

    def __init__(self, program: Program, cluster: ClusterSpec, *, max_events: int = 20000,
                 compute_cost=None, comm_cost=None):
        self.p = program
        self.skip: frozenset[str] = frozenset()
        self.cluster = cluster
        self.device = cluster.device_spec
        self.max_events = max_events
        self._compute_cost = compute_cost or self.compute_time
        self._comm_cost = comm_cost or self.comm_time

    # Costs.
    def compute_time(self, comp, instr: Instr) -> float:
        return roofline_time(self.p, comp, instr, self.device)

    def comm_time(self, comp, idx: int, instr: Instr, kind: str) -> float:
        c = self.p.collective_at(comp.name, instr.name)
        link = max((self.cluster.link_for(g) for g in c.groups), key=lambda lk: -lk.bytes_per_s,
                   default=self.cluster.levels[0][1])
        return collective_time(kind, c.bytes, max(c.group_size, 1), link)

    # Replay.
    def run(self) -> SimResult:
        return self.replay(self.p.module.entry)

    def replay(self, comp_name: str, skip: frozenset[str] = frozenset()) -> SimResult:
        """Replay computation `comp_name` alone, from idle streams."""
        self.skip = frozenset(skip)
        self.streams = Streams(events=self.max_events)
        self.pending: dict[str, int] = {}  # async collectives in flight: name -> task
        self._replay(comp_name)
        s = self.streams
        step = s.makespan
        return SimResult(step_s=step, compute_s=s.compute_s, comm_s=s.comm_s,
                         exposed_comm_s=max(step - s.compute_s, 0.0), events=s.events,
                         covered=s.covered(), windows=s.windows())

    def _replay(self, comp_name: str) -> None:
        comp = self.p.comp(comp_name)
        s = self.streams
        for idx, instr in enumerate(comp.instrs):
            kind = collective_kind(instr, self.p.module)
            if instr.name in self.skip:
                continue
            if instr.opcode == "while":
                body = instr.attr("body").lstrip("%")
                for _ in range(self.p.module.trip_count(instr) or 1):
                    self._replay(body)
            elif instr.opcode in ("call", "conditional"):
                self._replay(instr.called[0])
            elif kind and is_async_start(instr):
                cost = self._comm_cost(comp, idx, instr, kind)
                self.pending[instr.name] = s.issue(cost, kind=kind, name=instr.name)
            elif instr.opcode.endswith("-done") and instr.operands:
                task = self.pending.pop(instr.operands[0], None)
                if task is not None:
                    s.wait(task)
            elif kind:  # synchronous collective: both streams wait for each other
                s.wait(s.issue(self._comm_cost(comp, idx, instr, kind), kind=kind,
                               name=instr.name))
            else:
                s.add(COMPUTE, self._compute_cost(comp, instr), kind=instr.opcode,
                      name=instr.name)


def simulate(program: Program, cluster: ClusterSpec) -> SimResult:
    return Simulator(program, cluster).run()
