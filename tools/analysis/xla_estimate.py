"""XLA's own time estimate of a GPU program: the latency-hiding scheduler's schedule dump (read by
`xla_dump`) composed over loops into a step time and exposed communication by collective kind.
Compiling with the dump on is `xla_compile`.

A second opinion beside `oases_jax.tools.analysis.simulate`; see docs/xla_estimate.md.
"""

from __future__ import annotations

import dataclasses

from oases_jax.tools.analysis.hlo import COLLECTIVES
from oases_jax.tools.analysis.xla_dump import (
    Comp,
    Op,
    Scheduled,
    parse_text_proto,
    read_hlo_text,
    read_module,
    read_schedules,
)

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
    stream: str  # "compute", "comm", or "async" (non-collective work on another stream)
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
    instructions outside scheduled computations with no "sol" cost (counted as 0 s);
    `fused_attention`: cuDNN's fused-attention calls executed (`calls`), XLA's own price of them
    (`xla_s`) and the price used instead (`priced_s`, see `estimate_from_schedule`), or None."""

    step_s: float
    exposed_comm_s: dict[str, float]
    comm_s: dict[str, float]
    per_op: list[OpTime]
    scheduled_computations: list[str]
    unpriced_ops: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    fused_attention: dict[str, float] | None = None

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "exposed_comm_s": self.exposed_comm_s,
                "comm_s": self.comm_s, "per_op": [o.to_json() for o in self.per_op],
                "scheduled_computations": self.scheduled_computations,
                "unpriced_ops": self.unpriced_ops, "notes": self.notes,
                "fused_attention": self.fused_attention}


def _with_total(d: dict[str, float]) -> dict[str, float]:
    return {**{k: v for k, v in sorted(d.items())}, "total": sum(d.values())}


@dataclasses.dataclass
class _Run:
    """One run of a computation: time, exposed and collective time by kind (us), its
    instructions as (op, start, end, latency) in run order, relative to the run's start, and
    the ops it ran at our price (`calls`, XLA's price `xla` and ours `ours`, in us)."""

    time: float
    exposed: dict[str, float]
    comm: dict[str, float]
    spans: list[tuple[Op, float, float, float]]
    priced: dict[str, float] = dataclasses.field(default_factory=dict)


def _add(acc: dict[str, float], part: dict[str, float], times: float = 1.0) -> None:
    for k, v in part.items():
        acc[k] = acc.get(k, 0.0) + times * v


class _Composer:
    """Runs of computations, replayed as XLA's scheduler statistics replay them (see
    `estimate_from_schedule`), loops and calls composed bottom-up."""

    def __init__(self, comps: dict[int, Comp], scheduled: dict[int, Scheduled],
                 prices: dict[str, float] | None = None):
        self.comps, self.scheduled = comps, scheduled
        self.prices = prices or {}  # op name -> our price (us), in place of XLA's
        self.n_priced = 0  # ops run at a price from `prices` (each op once, not per execution)
        self._memo: dict[int, _Run] = {}
        self.unpriced: set[tuple[int, int]] = set()
        self.repriced: dict[str, int] = {}  # non-collective async ops: wrapped opcode -> count
        self.gaps: dict[str, float] = {}  # (replay - XLA's statistics) / statistics
        self.unknown_trips: set[str] = set()  # loops without a known trip count (run once)

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
        if n is None:
            self.unknown_trips.add(op.name)
        return int(n) if n is not None else 1

    def _latency(self, comp: Comp, op: Op, done: int | None) -> float:
        """How long an async op runs: a collective's "sol" price; for other async work (an
        async fusion, say), the composed time of what it wraps, not the scheduler's nominal
        5000 us; else the scheduler's own start-to-done distance."""
        coll = self.collective(op)
        if coll and coll[1] is not None:
            return coll[1]
        wrapped = [c for c in op.called if c in self.comps]
        if not coll and wrapped:
            inner = next((i.opcode for i in self.comps[wrapped[0]].ops.values()
                          if i.opcode not in _FREE), op.opcode)
            self.repriced[inner] = self.repriced.get(inner, 0) + 1
            return sum(self.run(c).time for c in wrapped)
        sched = self.scheduled.get(comp.id)
        if sched and done in sched.times and op.id in sched.times:
            return max(sched.times[done][0] - sched.times[op.id][0], 0.0)
        return 0.0

    def control(self, op: Op) -> _Run:
        """A while runs its body `trips` times and its condition `trips + 1` times (the dump
        lists the body first); a call runs its callees; a conditional its dearest branch."""
        parts = [c for c in op.called if c in self.comps]
        if op.opcode == "conditional":
            runs = [self.run(c) for c in parts]
            return max(runs, key=lambda r: r.time, default=_Run(0.0, {}, {}, []))
        if op.opcode == "while":
            n = self.trips(op)
            parts = list(zip(op.called[:2], (n, n + 1), strict=False))
        else:
            parts = [(c, 1) for c in parts]
        out = _Run(0.0, {}, {}, [])
        for cid, times in parts:
            if cid in self.comps:
                r = self.run(cid)
                out.time += times * r.time
                _add(out.exposed, r.exposed, times)
                _add(out.comm, r.comm, times)
                _add(out.priced, r.priced, times)
        return out

    def _cost(self, comp: Comp, op: Op, sched: Scheduled | None) -> float:
        """An instruction's own time: the scheduler's (end - start) where it scheduled the
        computation, else the "sol" price (free ops 0; others without a price 0, counted)."""
        if sched:
            start, end = sched.times.get(op.id, (0.0, 0.0))
            return end - start
        if (op.opcode in _FREE or op.opcode in _CONTROL or op.opcode.endswith(("-start", "-done"))
                or self.collective(op)):
            return 0.0  # control ops and collectives are priced by the caller
        cost = op.cost()
        if cost is None and op.name not in self.prices:
            self.unpriced.add((comp.id, op.id))
        return cost or 0.0

    def run(self, cid: int) -> _Run:
        if cid in self._memo:
            return self._memo[cid]
        comp, sched = self.comps[cid], self.scheduled.get(cid)
        dones = {op.operands[0]: op.id for op in comp.ops.values()
                 if op.opcode.endswith("-done") and op.operands}
        out = _Run(0.0, {}, {}, [])
        pending: dict[int, tuple[float, float, str | None]] = {}
        changed = self._changes()
        for oid in sched.order if sched else comp.order:
            op = comp.ops.get(oid)
            if op is None:
                continue
            t, cost, latency = out.time, self._cost(comp, op, sched), 0.0
            coll = self.collective(op)
            if op.name in self.prices:
                _add(out.priced, {"calls": 1, "xla": cost, "ours": self.prices[op.name]})
                cost = self.prices[op.name]
                self.n_priced += 1
            elif op.opcode in _CONTROL:
                child = self.control(op)
                cost = child.time
                _add(out.exposed, child.exposed)
                _add(out.comm, child.comm)
                _add(out.priced, child.priced)
            elif op.opcode.endswith("-start") and oid in dones:
                latency = self._latency(comp, op, dones[oid])
                pending[oid] = (t, latency, coll[0] if coll else None)
                if coll:
                    _add(out.comm, {coll[0]: latency})
            elif op.opcode.endswith("-done"):
                began, latency_, kind = pending.pop(op.operands[0] if op.operands else -1,
                                                    (t, 0.0, None))
                wait = max(latency_ - (t - began), 0.0)
                if kind:
                    _add(out.exposed, {kind: wait})
                t += wait
            elif coll:  # synchronous: nothing overlaps it
                cost = coll[1] if coll[1] is not None else cost
                _add(out.comm, {coll[0]: cost})
                _add(out.exposed, {coll[0]: cost})
            out.spans.append((op, t, t + cost, latency))
            out.time = t + cost
        if sched and changed == self._changes():
            self._use_statistics(comp, sched, out)
        self._memo[cid] = out
        return out

    def _changes(self) -> int:
        """Ops run so far at a price other than XLA's: where one did, XLA's statistics no longer
        describe the computation and the replay is used."""
        return sum(self.repriced.values()) + self.n_priced

    def _use_statistics(self, comp: Comp, sched: Scheduled, out: _Run) -> None:
        """XLA's own totals where nothing was repriced: its total cycles with each control op's
        nominal price replaced by the composed run, and its wasted cycles plus the children's.
        The replay agrees within a few percent (XLA's statistics charge about 0.5 us less for
        some exposed collectives); a note gives the largest difference."""
        controls = [(s, e, op) for op, s, e, _ in out.spans if op.opcode in _CONTROL]
        time, exposed = sched.total_us, dict(sched.wasted_us)
        for start, end, op in controls:
            nominal = sched.times.get(op.id, (0.0, 0.0))
            time += (end - start) - (nominal[1] - nominal[0])
            _add(exposed, self.control(op).exposed)
        if time > 0 and abs(out.time - time) > 0.01:
            self.gaps[comp.name] = (out.time - time) / time
        out.time, out.exposed = time, exposed

    def layout(self, cid: int, t0: float, out: list[OpTime], limit: int) -> None:
        """The timeline of one run of `cid` from t0 (us), loops unrolled."""
        for op, start, end, latency in self.run(cid).spans:
            if len(out) >= limit:
                return
            start, end = t0 + start, t0 + end
            coll = self.collective(op)
            if op.opcode in _CONTROL:
                self._layout_control(op, start, out, limit)
            elif op.opcode.endswith("-start") and latency > 0:
                kind, stream = (coll[0], "comm") if coll else (op.opcode, "async")
                out.append(OpTime(op.name, kind, stream, start, start + latency))
            elif coll and end > start:
                out.append(OpTime(op.name, coll[0], "comm", start, end))
            elif end > start and not op.opcode.endswith(("-start", "-done")):
                out.append(OpTime(op.name, op.opcode, "compute", start, end))

    def _layout_control(self, op: Op, t0: float, out: list[OpTime], limit: int) -> None:
        if op.opcode == "conditional":
            parts = [c for c in op.called if c in self.comps]
            if parts:
                self.layout(max(parts, key=lambda c: self.run(c).time), t0, out, limit)
            return
        if op.opcode != "while":
            for cid in (c for c in op.called if c in self.comps):
                self.layout(cid, t0, out, limit)
                t0 += self.run(cid).time
            return
        body, cond = (op.called + [None, None])[:2]
        steps = [cond, body] * self.trips(op) + [cond]  # the last test ends the loop
        for cid in steps:
            if len(out) >= limit:
                return
            if cid in self.comps:
                self.layout(cid, t0, out, limit)
                t0 += self.run(cid).time

    def estimate(self, entry: int, max_ops: int) -> XlaEstimate:
        r = self.run(entry)
        per_op: list[OpTime] = []
        self.layout(entry, 0.0, per_op, max_ops)
        us = 1e-6
        for o in per_op:
            o.start, o.end = o.start * us, o.end * us
        notes = []
        if self.repriced:
            what = ", ".join(f"{n} x {k}" for k, n in sorted(self.repriced.items()))
            notes.append(f"asynchronous non-collective ops ({what}) priced at what they wrap, "
                         "not at the scheduler's nominal 5000 us")
        if self.unknown_trips:
            notes.append(f"loops without a known trip count, counted once: "
                         f"{', '.join(sorted(self.unknown_trips))}")
        priced = None
        if r.priced.get("calls"):
            priced = {"calls": int(r.priced["calls"]), "xla_s": r.priced["xla"] * us,
                      "priced_s": r.priced["ours"] * us}
            notes.append(f"{priced['calls']} fused-attention calls priced from their shapes "
                         f"(roofline, {priced['priced_s'] * 1e3:.3f} ms), not at XLA's flat "
                         f"price ({priced['xla_s'] * 1e3:.3f} ms)")
        if self.gaps:
            worst = max(self.gaps, key=lambda k: abs(self.gaps[k]))
            notes.append(f"the timeline (a replay) and XLA's statistics, whose totals are used, "
                         f"differ in {len(self.gaps)} computation(s), at most "
                         f"{self.gaps[worst]:+.2%} ({worst})")
        return XlaEstimate(
            step_s=r.time * us,
            exposed_comm_s=_with_total({k: v * us for k, v in r.exposed.items() if v}),
            comm_s=_with_total({k: v * us for k, v in r.comm.items()}),
            per_op=per_op,
            scheduled_computations=sorted(self.comps[c].name for c in self.scheduled
                                          if c in self.comps),
            unpriced_ops=len(self.unpriced), notes=notes, fused_attention=priced)


def estimate_from_schedule(text: str, max_ops: int = MAX_OPS,
                           prices: dict[str, float] | None = None) -> XlaEstimate:
    """Compose XLA's estimate from one `<module>.schedule.txt`.

    The dump holds the module as the scheduler saw it, and a `computation_schedules` entry for
    each computation the latency-hiding scheduler scheduled (those holding async collectives):
    per-instruction start and end timestamps, and `scheduler_statistics` (wasted cycles per
    collective kind, total cycles). One run of a computation is replayed in schedule order the
    way XLA computes those statistics (`LatencyHidingStatistics`):

    - each instruction advances the clock by its cost: in a scheduled computation the
      scheduler's own (end - start timestamp; 1 us for an async start or done), elsewhere the
      "sol" `reification_cost` XLA's scheduler uses (fusions, GEMMs included; parameters,
      tuples and the like free; instructions with no "sol" price, plain copies for instance,
      which XLA prices at a nominal 0.01 us, count as 0 and are reported in `unpriced_ops`);
    - an async start sets off its work for its latency (a collective's "sol" price); its done
      waits for whatever of that latency the instructions in between did not cover, and for a
      collective that wait is its exposed (wasted) time;
    - a while costs trips x body + (trips + 1) x condition (trips from `known_trip_count`, 1 if
      unknown), a call its callee, a conditional its dearest branch, each run composed the same
      way; the scheduler's own nominal price of the control op is replaced.

    For a scheduled computation the totals are XLA's own statistics (its total cycles, the
    nominal price of each control op replaced by the composed run; its wasted cycles, plus the
    children's); the replay agrees with them within 3% on the layers measured (a note gives
    the largest difference) and gives the timeline. One departure: XLA's scheduler gives
    asynchronous non-collective work (an async fusion on another stream) a nominal 5000 us, a
    placeholder that would dominate the total; here it runs for the composed time of what it
    wraps (a note counts them). A collective in flight across a loop is scored as XLA scores it,
    each computation on its own, so the loop does not hide it. The timeline is this replay (the
    dump's own timestamps come from XLA's bottom-up list scheduler, which puts a stall right
    after a collective's start instead of before its done).

    A second departure: `prices` (seconds by instruction name) replaces XLA's price of those
    instructions, and a computation holding one is replayed rather than read from XLA's
    statistics. `xla_compile` passes cuDNN's fused-attention calls, which XLA prices at a flat
    10 us whatever their size (FLOPs it cannot see), priced by the simulator's roofline."""
    proto = parse_text_proto(text)
    if not proto.get("hlo_module"):
        raise ValueError("not a latency-hiding-schedule dump: no hlo_module")
    comps, entry = read_module(proto["hlo_module"][0])
    scheduled = read_schedules(proto.get("computation_schedules", []))
    return _Composer(comps, scheduled, _in_us(prices)).estimate(entry, max_ops)


def _in_us(prices: dict[str, float] | None) -> dict[str, float]:
    return {name: s * 1e6 for name, s in (prices or {}).items()}


def estimate_from_hlo_text(text: str, max_ops: int = MAX_OPS,
                           prices: dict[str, float] | None = None) -> XlaEstimate:
    """The estimate of a compiled program XLA scheduled without the latency-hiding scheduler
    (no async collective anywhere, so no schedule dump): the "sol" prices in its HLO text,
    composed as for unscheduled computations in `estimate_from_schedule` (`prices` as there)."""
    comps, entry = read_hlo_text(text)
    return _Composer(comps, {}, _in_us(prices)).estimate(entry, max_ops)


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
