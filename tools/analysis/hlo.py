"""Parse scheduled HLO text (`compiled.as_text()`) into computations and instructions.

The text is XLA's post-optimisation module: computations in definition order, each listing its
instructions in schedule order. This module only reads structure; `oases_jax.inspect` analyses it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0, "s4": 0.5,
    "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
}
COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
    "collective-broadcast", "ragged-all-to-all",
)
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_IOTA_RE = re.compile(r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?")
_CALL_ATTRS = ("calls", "to_apply", "body", "condition", "branch_computations",
               "true_computation", "false_computation", "async_execution_thread")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return int(math.prod(self.dims) * DTYPE_BYTES.get(self.dtype, 4))


def parse_shapes(text: str) -> list[Array]:
    """Every array in a (possibly tuple) type, in order; layouts `{1,0}` are ignored."""
    return [
        Array(dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in _ARRAY_RE.findall(text)
        if dt in DTYPE_BYTES
    ]


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    type_text: str
    operands: list[str]
    attrs: str
    is_root: bool = False
    operand_text: str = ""  # raw text between the parentheses (a constant's value)
    elements: tuple[int | None, ...] = ()  # per operand: the tuple element `%t#i` names, or None

    @functools.cached_property
    def shapes(self) -> list[Array]:
        return parse_shapes(self.type_text)

    @property
    def result_bytes(self) -> int:
        return sum(a.bytes for a in self.shapes)

    def element_bytes(self, index: int) -> int:
        """Bytes of element `index` of a tuple-shaped result (nested tuples counted whole)."""
        text = self.type_text.strip()
        if not text.startswith("("):
            return self.result_bytes
        parts, depth, start = [], 0, 1
        for i, c in enumerate(text[1:-1], 1):
            depth += c in "([{"
            depth -= c in ")]}"
            if c == "," and depth == 0:
                parts.append(text[start:i])
                start = i + 1
        parts.append(text[start:-1])
        return sum(a.bytes for a in parse_shapes(parts[index])) if index < len(parts) else 0

    def attr(self, key: str) -> str | None:
        """The raw text of attribute `key=...` (balanced brackets kept), or None."""
        m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", self.attrs)
        if not m:
            return None
        i = m.end()
        iota = _IOTA_RE.match(self.attrs, i)
        if iota:  # replica_groups=[2,4]<=[4,2]T(1,0)
            return iota.group(0)
        if i < len(self.attrs) and self.attrs[i] in "({[":
            return self.attrs[i:_balanced(self.attrs, i)]
        if self.attrs.startswith("mesh[", i):  # replica_groups=mesh['a'=2] {'a'}
            j = _balanced(self.attrs, i + 4)
            k = self.attrs.find("{", j)
            return self.attrs[i:_balanced(self.attrs, k)] if k >= 0 else self.attrs[i:j]
        j = i
        while j < len(self.attrs) and self.attrs[j] not in ",":
            j += 1
        return self.attrs[i:j].strip()

    @functools.cached_property
    def called(self) -> list[str]:
        out = []
        for key in _CALL_ATTRS:
            value = self.attr(key)
            if value:
                out += [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
        return out

    @functools.cached_property
    def backend_config(self) -> dict:
        return parse_backend_config(self.attr("backend_config"))


def parse_backend_config(text: str | None) -> dict:
    """An instruction's JSON `backend_config` as a dict ({} when absent or not JSON)."""
    if not text or not text.startswith("{"):
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    is_entry: bool = False

    @functools.cached_property
    def by_name(self) -> dict[str, Instr]:
        return {i.name: i for i in self.instrs}

    @property
    def root(self) -> Instr | None:
        return next((i for i in self.instrs if i.is_root), self.instrs[-1] if self.instrs else None)


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    root, name, rest = m.groups()
    rest = rest.strip()
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        # Array types may carry a layout with spaces only inside braces, e.g. f32[2]{0}.
        end = len(rest) if end < 0 else end
    type_text, rest = rest[:end], rest[end:].lstrip()
    m2 = re.match(r"([\w\-]+)\(", rest)
    if not m2:
        return None
    opcode = m2.group(1)
    close = _balanced(rest, m2.end() - 1)
    operand_text = rest[m2.end() : close - 1]
    # `%t#2` names element 2 of tuple-shaped `t` (XLA prints a loop's parameter elements so).
    refs = re.findall(r"%([\w.\-]+)(?:#(\d+))?", operand_text)
    attrs = rest[close:].lstrip(", ")
    return Instr(name, opcode, type_text, [n for n, _ in refs], attrs, bool(root), operand_text,
                 tuple(int(i) if i else None for _, i in refs))


@dataclasses.dataclass
class HloModule:
    computations: dict[str, Computation]
    entry: str

    def trip_count(self, while_instr: Instr) -> int | None:
        """A while loop's trip count: XLA's `known_trip_count`, else read from a loop condition
        of the form `i < constant` with `i` starting at a constant."""
        known = while_instr.backend_config.get("known_trip_count", {}).get("n")
        if known is not None:
            return int(known)
        cond = self.computations.get((while_instr.attr("condition") or "").lstrip("%"))
        if cond is None:
            return None
        consts = [
            int(i.operand_text)
            for i in self._flatten(cond)
            if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.operand_text.strip())
        ]
        return consts[0] if len(consts) == 1 else None

    def _flatten(self, comp: Computation):
        for i in comp.instrs:
            yield i
            for c in i.called:
                if c in self.computations and i.opcode == "fusion":
                    yield from self._flatten(self.computations[c])


def parse_module(text: str) -> HloModule:
    computations: dict[str, Computation] = {}
    entry = None
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            m = _COMP_RE.match(line)
            if m:
                current = Computation(m.group(2), [], bool(m.group(1)))
                if current.is_entry:
                    entry = current.name
            continue
        # A computation ends at its closing brace, which may carry attributes: XLA's
        # multi-streamed windowed einsum puts GEMMs on another thread, `}, execution_thread=...`.
        if line.startswith("}"):
            computations[current.name] = current
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.instrs.append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return HloModule(computations, entry)


# Replica groups -> lists of device ids.


def _iota_groups(text: str) -> list[list[int]]:
    """`[G,S]<=[d0,d1,...]T(p...)`: iota over dims, transposed by p, reshaped to G groups."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m is None:
        raise ValueError(f"unreadable replica groups {text!r}")
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out_shape[0], -1).tolist()


def _mesh_groups(text: str) -> list[list[int]]:
    """`mesh['a'=2,'b'=4] {'b'}`: groups of devices that differ only along the listed axes."""
    axes = re.findall(r"'([^']+)'=(\d+)", text[: text.index("]") + 1])
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    chosen = re.findall(r"'([^']+)'", text[text.index("]") + 1 :])
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    keep = [i for i, n in enumerate(names) if n in chosen]
    rest = [i for i in range(len(names)) if i not in keep]
    return ids.transpose(rest + keep).reshape(-1, math.prod(sizes[i] for i in keep) or 1).tolist()


def replica_groups(instr: Instr, num_devices: int) -> list[list[int]]:
    """Device groups of a collective (all devices in one group when the attribute is empty)."""
    text = instr.attr("replica_groups")
    if text is None or text in ("{}", ""):
        return [list(range(num_devices))]
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("["):
        return _iota_groups(text)
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text[1:-1])]


def source_target_pairs(instr: Instr) -> list[tuple[int, int]]:
    text = instr.attr("source_target_pairs") or ""
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text)]
