"""XLA's own time estimate of a GPU program: the latency-hiding scheduler's schedule dump, read
back and composed over loops into a step time and exposed communication by collective kind.

A second opinion beside `oases_jax.simulate`; see docs/xla_estimate.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator

from oases_jax.hlo import COLLECTIVES

# Per-compile options that make XLA write `<module>.schedule.txt` and fill each instruction's
# `reification_cost` (the "sol" entry is what the scheduler uses). `xla_dump_to` is added per call.
DUMP_OPTIONS = {"xla_dump_latency_hiding_schedule": True, "xla_gpu_collect_cost_model_stats": True}
# Opcodes that move no data; they cost nothing here as in XLA's estimator.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                   "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"})
_CONTROL = frozenset({"while", "call", "conditional"})
MAX_OPS = 20000


# Text-format protobuf, read generically: nested dicts whose values are lists (fields repeat).

_OPEN = re.compile(r"^\s*(\w+)\s*\{\s*$")
_FIELD = re.compile(r"^\s*(\w+)\s*:\s*(.*?)\s*$")
_ESC = re.compile(r"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{2})|(.))")
_SIMPLE_ESC = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "'": "'", "\\": "\\"}
# The only parts of the dump read here (everything else is skipped unparsed, which keeps large
# dumps fast): message name -> fields kept.
_KEEP = {
    "": {"hlo_module", "computation_schedules"},
    "hlo_module": {"name", "entry_computation_name", "entry_computation_id", "computations",
                   "schedule"},
    "computations": {"name", "id", "instructions", "is_fusion_computation"},
    "instructions": {"name", "opcode", "id", "called_computation_ids", "backend_config",
                     "start_timestamp_cycles", "end_timestamp_cycles"},
    "schedule": {"sequences"},
    "sequences": {"key", "value"},
    "value": {"instruction_ids"},
    "computation_schedules": {"computation_id", "instructions", "scheduler_statistics",
                              "cycles_per_microsecond"},
    "scheduler_statistics": None,  # every field
}


def _unescape(text: str) -> str:
    def sub(m):
        if m.group(1):
            return chr(int(m.group(1), 8))
        if m.group(2):
            return chr(int(m.group(2), 16))
        return _SIMPLE_ESC.get(m.group(3), m.group(3))

    return _ESC.sub(sub, text)


def _value(text: str):
    if text.startswith('"'):
        return _unescape(text[1:-1])
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        return text  # enums, true/false


def parse_text_proto(text: str) -> dict:
    """A text-format protobuf as nested dicts of lists, keeping only the fields in `_KEEP`."""
    root: dict = {}
    stack = [("", root)]
    skip = 0
    for line in text.splitlines():
        if skip:
            stripped = line.strip()
            if stripped.endswith("{") and _OPEN.match(line):
                skip += 1
            elif stripped == "}":
                skip -= 1
            continue
        name, node = stack[-1]
        keep = _KEEP.get(name, set())
        m = _OPEN.match(line)
        if m:
            key = m.group(1)
            if keep is not None and key not in keep:
                skip = 1
                continue
            child: dict = {}
            node.setdefault(key, []).append(child)
            stack.append((key, child))
            continue
        if line.strip() == "}":
            stack.pop()
            continue
        m = _FIELD.match(line)
        if m and (keep is None or m.group(1) in keep):
            node.setdefault(m.group(1), []).append(_value(m.group(2)))
    return root


# The program as the scheduler saw it.


@dataclasses.dataclass
class _Op:
    id: int
    name: str
    opcode: str
    called: list[int]
    config: dict

    def cost(self, key: str = "sol") -> float | None:
        """The `reification_cost` entry named `key`, in microseconds."""
        for entry in self.config.get("reification_cost", []):
            if entry.get("name") == key:
                return float(entry.get("exec_time_us", 0.0))
        return None


@dataclasses.dataclass
class _Comp:
    id: int
    name: str
    ops: dict[int, _Op]
    order: list[int]
    is_fusion: bool


@dataclasses.dataclass
class _Scheduled:
    """One computation the latency-hiding scheduler scheduled: its order, timestamps (us) and
    statistics (wasted cycles by kind, total cycles), converted to microseconds."""

    order: list[int]
    times: dict[int, tuple[float, float]]
    wasted_us: dict[str, float]
    total_us: float


def _first(d: dict, key: str, default=None):
    return d.get(key, [default])[0]


def _config(text: str | None) -> dict:
    if not text or not text.startswith("{"):
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}


def _read_module(msg: dict) -> tuple[dict[int, _Comp], int]:
    orders = {_first(s, "key"): _first(s, "value", {}).get("instruction_ids", [])
              for sched in msg.get("schedule", []) for s in sched.get("sequences", [])}
    comps = {}
    for c in msg.get("computations", []):
        ops = {}
        for i in c.get("instructions", []):
            op = _Op(_first(i, "id"), _first(i, "name", ""), _first(i, "opcode", ""),
                     list(i.get("called_computation_ids", [])),
                     _config(_first(i, "backend_config")))
            ops[op.id] = op
        cid = _first(c, "id")
        order = [i for i in orders.get(cid, []) if i in ops] or list(ops)
        comps[cid] = _Comp(cid, _first(c, "name", ""), ops, order,
                           bool(_first(c, "is_fusion_computation", False)))
    entry = _first(msg, "entry_computation_id")
    if entry is None:
        name = _first(msg, "entry_computation_name")
        entry = next(c.id for c in comps.values() if c.name == name)
    return comps, entry


def _read_schedules(msgs: list[dict]) -> dict[int, _Scheduled]:
    out = {}
    for s in msgs:
        per_us = float(_first(s, "cycles_per_microsecond", 1) or 1)
        stats = _first(s, "scheduler_statistics", {})
        wasted = {k.removesuffix("_wasted_cycles").replace("_", "-"): float(v[0]) / per_us
                  for k, v in stats.items()
                  if k.endswith("_wasted_cycles") and k != "total_wasted_cycles" and v[0]}
        order, times = [], {}
        for i in s.get("instructions", []):
            iid = _first(i, "id")
            order.append(iid)
            times[iid] = (float(_first(i, "start_timestamp_cycles", 0)) / per_us,
                          float(_first(i, "end_timestamp_cycles", 0)) / per_us)
        out[_first(s, "computation_id")] = _Scheduled(
            order, times, wasted, float(_first(stats, "total_cycles", 0)) / per_us)
    return out


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

    def __init__(self, comps: dict[int, _Comp], scheduled: dict[int, _Scheduled]):
        self.comps, self.scheduled = comps, scheduled
        self.by_name = {c.name: c.id for c in comps.values()}
        self._memo: dict[int, tuple[float, dict, dict]] = {}
        self.unpriced: set[tuple[int, int]] = set()

    def collective(self, op: _Op) -> tuple[str, float | None] | None:
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

    def trips(self, op: _Op) -> int:
        n = op.config.get("known_trip_count", {}).get("n")
        return int(n) if n is not None else 1

    def loop_parts(self, op: _Op) -> list[tuple[int, int]]:
        """(computation id, runs) of a control-flow op: a while runs its body `trips` times and
        its condition `trips + 1` times; a call runs its callee once."""
        if op.opcode == "while":
            # called_computation_ids lists the body, then the condition.
            n = self.trips(op)
            body, cond = (op.called + [None, None])[:2]
            return [(c, r) for c, r in ((body, n), (cond, n + 1)) if c in self.comps]
        return [(c, 1) for c in op.called if c in self.comps]

    def control_time(self, op: _Op) -> tuple[float, dict, dict]:
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

    def _layout_control(self, op: _Op, t0: float, out: list[OpTime], limit: int) -> None:
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
    comps, entry = _read_module(proto["hlo_module"][0])
    scheduled = _read_schedules(proto.get("computation_schedules", []))
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
            ops[j] = _Op(j, instr.name, instr.opcode, called, instr.backend_config)
        comps[ids[name]] = _Comp(ids[name], name, ops, list(ops), False)
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
    comps, _ = _read_module(parse_text_proto(text)["hlo_module"][0])
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
