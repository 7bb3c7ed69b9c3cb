"""Read XLA's latency-hiding schedule dump (`<module>.schedule.txt`, a text protobuf): the module
as the scheduler saw it, and each scheduled computation's timestamps and statistics."""

from __future__ import annotations

import dataclasses
import re

from oases_jax.tools.analysis.hlo import parse_backend_config, parse_module

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
    "instructions": {"name", "opcode", "id", "operand_ids", "called_computation_ids",
                     "backend_config", "start_timestamp_cycles", "end_timestamp_cycles"},
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
class Op:
    id: int
    name: str
    opcode: str
    called: list[int]
    config: dict
    operands: list[int] = dataclasses.field(default_factory=list)

    def cost(self, key: str = "sol") -> float | None:
        """The `reification_cost` entry named `key`, in microseconds."""
        for entry in self.config.get("reification_cost", []):
            if entry.get("name") == key:
                return float(entry.get("exec_time_us", 0.0))
        return None


@dataclasses.dataclass
class Comp:
    id: int
    name: str
    ops: dict[int, Op]
    order: list[int]
    is_fusion: bool


@dataclasses.dataclass
class Scheduled:
    """One computation the latency-hiding scheduler scheduled: its order, timestamps (us) and
    statistics (wasted cycles by kind, total cycles), converted to microseconds."""

    order: list[int]
    times: dict[int, tuple[float, float]]
    wasted_us: dict[str, float]
    total_us: float


def _first(d: dict, key: str, default=None):
    return d.get(key, [default])[0]


def read_module(msg: dict) -> tuple[dict[int, Comp], int]:
    orders = {_first(s, "key"): _first(s, "value", {}).get("instruction_ids", [])
              for sched in msg.get("schedule", []) for s in sched.get("sequences", [])}
    comps = {}
    for c in msg.get("computations", []):
        ops = {}
        for i in c.get("instructions", []):
            op = Op(_first(i, "id"), _first(i, "name", ""), _first(i, "opcode", ""),
                    list(i.get("called_computation_ids", [])),
                    parse_backend_config(_first(i, "backend_config")),
                    list(i.get("operand_ids", [])))
            ops[op.id] = op
        cid = _first(c, "id")
        order = [i for i in orders.get(cid, []) if i in ops] or list(ops)
        comps[cid] = Comp(cid, _first(c, "name", ""), ops, order,
                          bool(_first(c, "is_fusion_computation", False)))
    entry = _first(msg, "entry_computation_id")
    if entry is None:
        name = _first(msg, "entry_computation_name")
        entry = next(c.id for c in comps.values() if c.name == name)
    return comps, entry


def read_hlo_text(text: str) -> tuple[dict[int, Comp], int]:
    """A compiled module's HLO text (`compiled.as_text()`) read as `read_module` reads the dump's
    module: computations numbered in text order, instructions in schedule order, a while's body
    before its condition, as in the dump."""
    module = parse_module(text)
    ids = {name: i for i, name in enumerate(module.computations)}
    comps = {}
    for name, c in module.computations.items():
        index = {instr.name: j for j, instr in enumerate(c.instrs)}
        ops = {}
        for j, instr in enumerate(c.instrs):
            called = [ids[n] for n in instr.called if n in ids]
            if instr.opcode == "while":  # body first, as in the dump
                body = (instr.attr("body") or "").lstrip("%")
                cond = (instr.attr("condition") or "").lstrip("%")
                called = [ids[n] for n in (body, cond) if n in ids]
            operands = [index[o] for o in instr.operands if o in index]
            ops[j] = Op(j, instr.name, instr.opcode, called, instr.backend_config, operands)
        comps[ids[name]] = Comp(ids[name], name, ops, list(ops), False)
    return comps, ids[module.entry]


def read_schedules(msgs: list[dict]) -> dict[int, Scheduled]:
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
        out[_first(s, "computation_id")] = Scheduled(
            order, times, wasted, float(_first(stats, "total_cycles", 0)) / per_us)
    return out
