"""XLA's own time estimate of a GPU program: the latency-hiding scheduler's schedule dump, read
back and composed over loops into a step time and exposed communication by collective kind.

A second opinion beside `oases_jax.simulate`; see docs/xla_estimate.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator

from oases_jax.hlo import COLLECTIVES
from oases_jax.xla_dump import Comp, Op, Scheduled, parse_text_proto, read_module, read_schedules

# Per-compile options that make XLA write `<module>.schedule.txt` and fill each instruction's
# `reification_cost` (the "sol" entry is what the scheduler uses). `xla_dump_to` is added per call.
DUMP_OPTIONS = {"xla_dump_latency_hiding_schedule": True, "xla_gpu_collect_cost_model_stats": True}
# Opcodes that move no data; they cost nothing here as in XLA's estimator.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                   "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"})
_CONTROL = frozenset({"while", "call", "conditional"})
MAX_OPS = 20000


# Composition.


@dataclasses.dataclass
class OpTime:
    name: str  # XLA's scheduling name (`scheduling_name` in the compiled HLO's metadata)
    kind: str  # the collective kind, or the opcode
    stream: str  # "compute" or "comm"
    start: float  # seconds from the start of the program
    end: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class XlaEstimate:
    """XLA's estimate of one execution of a compiled program, per device.

    `step_s`: total time; `exposed_comm_s`: collective time not hidden behind compute, by kind
    plus "total"; `comm_s`: XLA's price of every collective executed, by kind plus "total";
    `per_op`: XLA's timeline (loops unrolled, at most `MAX_OPS` entries); `unpriced_ops`:
    instructions outside scheduled computations with no "sol" cost (counted as 0 s)."""

    step_s: float
    exposed_comm_s: dict[str, float]
    comm_s: dict[str, float]
    per_op: list[OpTime]
    scheduled_computations: list[str]
    unpriced_ops: int = 0

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "exposed_comm_s": self.exposed_comm_s,
                "comm_s": self.comm_s, "per_op": [o.to_json() for o in self.per_op],
                "scheduled_computations": self.scheduled_computations,
                "unpriced_ops": self.unpriced_ops}


def _with_total(d: dict[str, float]) -> dict[str, float]:
    return {**{k: v for k, v in sorted(d.items())}, "total": sum(d.values())}


class _Composer:
    """Totals of computations, composed bottom-up (see `estimate_from_schedule`)."""

    def __init__(self, comps: dict[int, Comp], scheduled: dict[int, Scheduled]):
        self.comps, self.scheduled = comps, scheduled
        self.by_name = {c.name: c.id for c in comps.values()}
        self._memo: dict[int, tuple[float, dict, dict]] = {}
        self.unpriced: set[tuple[int, int]] = set()

    def collective(self, op: Op) -> tuple[str, float | None] | None:
        """(kind, XLA's latency in us) when `op` starts or is a collective."""
        base = op.opcode.removesuffix("-start")
        if base in COLLECTIVES:
            return base, op.cost()
        if op.opcode == "async-start" and op.called:
            wrapped = self.comps.get(op.called[0])
            if wrapped is not None:
                for inner in wrapped.ops.values():
                    if inner.opcode in COLLECTIVES:
                        return inner.opcode, inner.cost() or op.cost()
        return None

    def trips(self, op: Op) -> int:
        n = op.config.get("known_trip_count", {}).get("n")
        return int(n) if n is not None else 1

    def loop_parts(self, op: Op) -> list[tuple[int, int]]:
        """(computation id, runs) of a control-flow op: a while runs its body `trips` times and
        its condition `trips + 1` times; a call runs its callee once."""
        if op.opcode == "while":
            # called_computation_ids lists the body, then the condition.
            n = self.trips(op)
            body, cond = (op.called + [None, None])[:2]
            return [(c, r) for c, r in ((body, n), (cond, n + 1)) if c in self.comps]
        return [(c, 1) for c in op.called if c in self.comps]

    def control_time(self, op: Op) -> tuple[float, dict, dict]:
        if op.opcode == "conditional":  # the dearest branch
            parts = [self.total(c) for c in op.called if c in self.comps]
            return max(parts, key=lambda p: p[0], default=(0.0, {}, {}))
        t, exposed, comm = 0.0, {}, {}
        for cid, runs in self.loop_parts(op):
            ct, ce, cc = self.total(cid)
            t += runs * ct
            for acc, part in ((exposed, ce), (comm, cc)):
                for k, v in part.items():
                    acc[k] = acc.get(k, 0.0) + runs * v
        return t, exposed, comm

    def total(self, cid: int) -> tuple[float, dict, dict]:
        """(time us, exposed us by kind, collective us by kind) of one run of a computation."""
        if cid in self._memo:
            return self._memo[cid]
        comp, sched = self.comps[cid], self.scheduled.get(cid)
        exposed = dict(sched.wasted_us) if sched else {}
        comm: dict[str, float] = {}
        t = sched.total_us if sched else 0.0
        for oid in sched.order if sched else comp.order:
            op = comp.ops.get(oid)
            if op is None:
                continue
            coll = self.collective(op)
            if coll:
                comm[coll[0]] = comm.get(coll[0], 0.0) + (coll[1] or 0.0)
            elif op.opcode in _CONTROL:
                ct, ce, cc = self.control_time(op)
                if sched:  # replace the scheduler's nominal price of the control op
                    start, end = sched.times.get(oid, (0.0, 0.0))
                    t -= end - start
                t += ct
                for acc, part in ((exposed, ce), (comm, cc)):
                    for k, v in part.items():
                        acc[k] = acc.get(k, 0.0) + v
            elif not sched and op.opcode not in _FREE and not op.opcode.endswith("-done"):
                cost = op.cost()
                if cost is None:
                    self.unpriced.add((cid, oid))
                t += cost or 0.0
        self._memo[cid] = (t, exposed, comm)
        return self._memo[cid]

    def layout(self, cid: int, t0: float, out: list[OpTime], limit: int) -> None:
        """XLA's timeline of one run of `cid` from t0 (us): a scheduled computation's own
        timestamps, shifted after each loop by the loop's composed time; others back to back."""
        comp, sched = self.comps[cid], self.scheduled.get(cid)
        shift, clock = 0.0, t0
        for oid in sched.order if sched else comp.order:
            if len(out) >= limit:
                return
            op = comp.ops.get(oid)
            if op is None or op.opcode.endswith("-done"):
                continue
            if sched:
                start, end = sched.times.get(oid, (0.0, 0.0))
                start, end = t0 + shift + start, t0 + shift + end
            else:
                cost = 0.0 if op.opcode in _FREE or op.opcode in _CONTROL else (op.cost() or 0.0)
                start, end = clock, clock + cost
            coll = self.collective(op)
            if coll:
                latency = coll[1] if coll[1] is not None else end - start
                out.append(OpTime(op.name, coll[0], "comm", start, start + latency))
            elif op.opcode in _CONTROL:
                ct = self.control_time(op)[0]
                self._layout_control(op, start, out, limit)
                if sched:
                    shift += ct - (end - start)
                end = start + ct
            elif end > start:
                out.append(OpTime(op.name, op.opcode, "compute", start, end))
            clock = end

    def _layout_control(self, op: Op, t0: float, out: list[OpTime], limit: int) -> None:
        if op.opcode == "conditional":
            dearest = max((c for c in op.called if c in self.comps),
                          key=lambda c: self.total(c)[0], default=None)
            if dearest is not None:
                self.layout(dearest, t0, out, limit)
            return
        if op.opcode == "call":
            for cid in op.called:
                if cid in self.comps:
                    self.layout(cid, t0, out, limit)
                    t0 += self.total(cid)[0]
            return
        body, cond = (op.called + [None, None])[:2]
        t_cond = self.total(cond)[0] if cond in self.comps else 0.0
        for _ in range(self.trips(op)):
            if len(out) >= limit:
                return
            if cond in self.comps:
                self.layout(cond, t0, out, limit)
            t0 += t_cond
            if body in self.comps:
                self.layout(body, t0, out, limit)
                t0 += self.total(body)[0]
        if cond in self.comps:  # the last test, which ends the loop
            self.layout(cond, t0, out, limit)


def estimate_from_schedule(text: str, max_ops: int = MAX_OPS) -> XlaEstimate:
    """Compose XLA's estimate from one `<module>.schedule.txt`.

    The dump holds the module as the scheduler saw it, and a `computation_schedules` entry for
    each computation the latency-hiding scheduler scheduled (those holding async collectives):
    per-instruction start and end timestamps, and `scheduler_statistics` with the wasted
    (exposed) cycles per collective kind and the total cycles, all in cycles of
    `cycles_per_microsecond`. The time of one run of a computation is composed bottom-up:

    - scheduled: its `total_cycles`, minus the scheduler's own price of each while/call/
      conditional in it (end - start timestamp, a nominal few ns), plus the composed time of
      what that op runs; its exposed time is its `<kind>_wasted_cycles` plus its children's;
    - not scheduled (for example an entry computation around a loop): the sum of the "sol"
      `reification_cost` of its instructions (the price XLA's scheduler gives fusions, GEMMs
      included), with parameters, tuples, bitcasts and the like free, and other instructions
      that carry no "sol" price (plain copies, for instance, which XLA itself prices at a
      nominal 0.01 us) counted as 0 and reported in `unpriced_ops`;
    - a while: trips x body + (trips + 1) x condition, trips from `known_trip_count` (1 if
      unknown); a call: its callee; a conditional: its dearest branch.

    A collective in flight across a loop is scored as XLA scores it: each computation on its
    own, so the loop does not hide it. The timestamps come from XLA's bottom-up list scheduler,
    which places a stall right after a collective's start rather than before its done, and can
    differ by a few cycles from the statistics, which XLA recomputes over the final order; the
    totals here use the statistics."""
    proto = parse_text_proto(text)
    if not proto.get("hlo_module"):
        raise ValueError("not a latency-hiding-schedule dump: no hlo_module")
    comps, entry = read_module(proto["hlo_module"][0])
    scheduled = read_schedules(proto.get("computation_schedules", []))
    composer = _Composer(comps, scheduled)
    t, exposed, comm = composer.total(entry)
    per_op: list[OpTime] = []
    composer.layout(entry, 0.0, per_op, max_ops)
    us = 1e-6
    for o in per_op:
        o.start, o.end = o.start * us, o.end * us
    return XlaEstimate(
        step_s=t * us,
        exposed_comm_s=_with_total({k: v * us for k, v in exposed.items()}),
        comm_s=_with_total({k: v * us for k, v in comm.items()}),
        per_op=per_op,
        scheduled_computations=sorted(comps[c].name for c in scheduled if c in comps),
        unpriced_ops=len(composer.unpriced),
    )


def estimate_from_hlo_text(text: str) -> XlaEstimate:
    """The estimate of a compiled program XLA scheduled without the latency-hiding scheduler
    (no async collective anywhere, so no schedule dump): the "sol" prices in its HLO text,
    composed as for unscheduled computations in `estimate_from_schedule`."""
    from oases_jax.hlo import parse_module

    module = parse_module(text)
    ids = {name: i for i, name in enumerate(module.computations)}
    comps = {}
    for name, c in module.computations.items():
        ops = {}
        for j, instr in enumerate(c.instrs):
            called = [ids[n] for n in instr.called if n in ids]
            if instr.opcode == "while":  # body first, as in the dump
                body, cond = (instr.attr("body") or "").lstrip("%"), (
                    instr.attr("condition") or "").lstrip("%")
                called = [ids[n] for n in (body, cond) if n in ids]
            ops[j] = Op(j, instr.name, instr.opcode, called, instr.backend_config)
        comps[ids[name]] = Comp(ids[name], name, ops, list(ops), False)
    composer = _Composer(comps, {})
    t, _, comm = composer.total(ids[module.entry])
    per_op: list[OpTime] = []
    composer.layout(ids[module.entry], 0.0, per_op, MAX_OPS)
    for o in per_op:
        o.start, o.end = o.start * 1e-6, o.end * 1e-6
    return XlaEstimate(step_s=t * 1e-6, exposed_comm_s={"total": 0.0},
                       comm_s=_with_total({k: v * 1e-6 for k, v in comm.items()}),
                       per_op=per_op, scheduled_computations=[],
                       unpriced_ops=len(composer.unpriced))


def collective_prices(text: str) -> list[tuple[str, str, float | None]]:
    """(name, kind, XLA's time in seconds or None) of every collective in a schedule dump, as
    XLA's latency estimator prices it (the "sol" cost of the collective)."""
    comps, _ = read_module(parse_text_proto(text)["hlo_module"][0])
    composer = _Composer(comps, {})
    wrapped = {c for comp in comps.values() for op in comp.ops.values()
               if op.opcode == "async-start" for c in op.called}
    out = []
    for comp in comps.values():
        if comp.id in wrapped:
            continue
        for op in comp.ops.values():
            coll = composer.collective(op)
            if coll:
                out.append((op.name, coll[0], None if coll[1] is None else coll[1] * 1e-6))
    return out


# Compiling with the dump.


@contextlib.contextmanager
def schedule_dump() -> Iterator[tuple[dict, pathlib.Path]]:
    """Compiler options that dump the schedule into a fresh directory, removed on exit (errors
    included): `with schedule_dump() as (options, where): lowered.compile(compiler_options={
    **mine, **options})`, then `read_dump(where)`."""
    where = pathlib.Path(tempfile.mkdtemp(prefix="oases-xla-dump-"))
    try:
        yield {"xla_dump_to": str(where), **DUMP_OPTIONS}, where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def schedule_files(where: pathlib.Path) -> list[pathlib.Path]:
    return sorted(where.glob("*.schedule.txt"))


def read_dump(where: pathlib.Path, compiled_text: str | None = None) -> XlaEstimate:
    """The estimate from a dump directory holding one compiled module. Without a schedule file
    (nothing was asynchronous, so the scheduler had nothing to schedule) it is composed from
    `compiled_text`, the compiled HLO, which carries the same "sol" prices."""
    files = schedule_files(where)
    if len(files) > 1:
        raise ValueError(f"dump {where} holds {len(files)} schedules; compile one module per dump")
    if files:
        return estimate_from_schedule(files[0].read_text())
    if compiled_text is None:
        raise ValueError(f"dump {where} holds no *.schedule.txt and no compiled HLO was given")
    if re.search(r"(?:async|all-reduce|all-gather|collective-permute)-start\(", compiled_text):
        raise ValueError(
            "the compiled program has asynchronous collectives but XLA wrote no schedule dump: "
            "a persistent compilation-cache hit skips the compiler; compile with "
            "jax.config.update('jax_enable_compilation_cache', False)")
    return estimate_from_hlo_text(compiled_text)


def compile_with_estimate(lowered, compiler_options: dict | None = None):
    """`lowered.compile(...)` with the schedule dump on, for a GPU target: (compiled, estimate).
    The dump directory is removed before this returns or raises. An XLA that refuses the dump
    options gets a plain compile and the estimate is None (a warning says why)."""
    with schedule_dump() as (options, where):
        try:
            compiled = lowered.compile(compiler_options={**(compiler_options or {}), **options})
        except Exception as e:  # retried without the dump; a genuine failure raises again
            compiled = lowered.compile(compiler_options=compiler_options or {})
            warnings.warn(f"XLA's schedule dump is unavailable ({str(e)[:200]}); "
                          "no XLA estimate", stacklevel=2)
            return compiled, None
        return compiled, read_dump(where, compiled.as_text())
