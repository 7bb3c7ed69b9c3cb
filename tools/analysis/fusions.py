"""Where a compiled step's time goes outside the GEMMs: a per-op account of the compute it
runs (bytes read and written, FLOPs, the roofline time `simulate.roofline_time` gives it, how
many times it runs per step), grouped by what it belongs to.

Grouping reads the name scopes the model and train step put on their ops (`SCOPES`, set with
`jax.named_scope`, which survive into each HLO op's `op_name`): a fusion belongs to the scope
most of its ops carry. Ops outside any scope are told apart by what they do: a fusion that only
moves data is "convert" when it changes a dtype and "copy" when not (slicing a layer's weights
out of the stack, writing its gradients into it), the rest "other". The phase (forward, backward,
recompute) is read from the same names: JAX names backward ops `transpose(...)` and recomputed
ones `rematted_computation`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable

from oases_jax.hardware import DeviceSpec
from oases_jax.tools.analysis.attention import is_fused_attention
from oases_jax.tools.analysis.hlo import Computation, Instr
from oases_jax.tools.analysis.program import Program
from oases_jax.tools.analysis.simulate import roofline_time

# Name scopes the project's code puts on its ops (models/layers.py, models/transformer.py,
# training/state.py), in the order a fusion spanning two is attributed (the first wins a tie).
SCOPES = ("optimizer", "loss", "embed", "attention", "rope", "norm", "activation", "bias",
          "residual")
# Ops that move or reinterpret data without arithmetic: a fusion of only these is a copy or a
# dtype conversion.
_MOVES = {"convert", "bitcast", "copy", "transpose", "reshape", "broadcast", "parameter", "tuple",
          "get-tuple-element", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate",
          "constant", "pad", "bitcast-convert"}
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_INNERMOST = re.compile(r"^(?:[\w.]+\()*([\w.]*)\)*$")


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One compute op of the compiled step, and what it costs per step."""

    name: str
    computation: str
    opcode: str
    category: str  # "gemm", "attention_kernel", or a scope of SCOPES, "convert", "other"
    phase: str  # "forward", "backward", "recompute", "update"
    calls: int  # per step (loop trip counts multiplied out)
    flops: float  # per call
    bytes: int  # HBM bytes read and written, per call
    seconds: float  # roofline time per call

    @property
    def total_s(self) -> float:
        return self.calls * self.seconds

    @property
    def total_bytes(self) -> int:
        return self.calls * self.bytes

    @property
    def gemm(self) -> bool:
        return self.category in ("gemm", "attention_kernel")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "total_s": self.total_s,
                "total_bytes": self.total_bytes}


def _leaves(program: Program, instr: Instr):
    """The op itself, or every op inside it (nested fusions opened) when it is a fusion."""
    if instr.opcode not in ("fusion", "fusion-start"):
        yield instr
        return
    for c in instr.called:
        if c in program.module.computations:
            for inner in program.module.computations[c].instrs:
                yield from _leaves(program, inner)


def _op_names(program: Program, instr: Instr) -> list[str]:
    """The `op_name`s of an op, and of every op inside it when it is a fusion."""
    names = _OP_NAME.findall(instr.attrs)
    if instr.opcode in ("fusion", "fusion-start"):
        names += [n for leaf in _leaves(program, instr) for n in _OP_NAME.findall(leaf.attrs)]
    return names


def _leaf_opcodes(program: Program, instr: Instr) -> set[str]:
    """The opcodes inside an op (itself if not a fusion), scalar index arithmetic left out."""
    return {leaf.opcode for leaf in _leaves(program, instr) if leaf.result_bytes > 8}


def categorize(program: Program, instr: Instr) -> tuple[str, str]:
    """(category, phase) of a compute op."""
    names = _op_names(program, instr)
    if "recompute" in instr.name or any("rematted_computation" in n for n in names):
        phase = "recompute"
    elif any("transpose(" in n for n in names):
        phase = "backward"
    elif any("/optimizer" in n or n.startswith("optimizer") for n in names):
        phase = "update"
    else:
        phase = "forward"
    if program.is_gemm(instr):
        return ("attention_kernel" if is_fused_attention(instr) else "gemm"), phase
    votes = collections.Counter()
    for n in names:
        # A scope entered inside a transformation shows as "jvp(loss)", "transpose(jvp(loss))".
        parts = {_INNERMOST.sub(r"\1", part) for part in n.split("/")}
        for scope in SCOPES:
            if scope in parts:
                votes[scope] += 1
                break
    if votes:
        best = max(votes.values())
        return next(s for s in SCOPES if votes[s] == best), phase
    leaves = _leaf_opcodes(program, instr)
    if leaves <= _MOVES:
        return ("convert" if "convert" in leaves else "copy"), phase
    return "other", phase


def account(program: Program, device: DeviceSpec) -> list[OpCost]:
    """Every compute op the step runs (each loop body's ops once per trip), costed."""
    rows: list[OpCost] = []
    for comp, count in program.walk():
        for instr in comp.instrs:
            if instr.opcode in ("while", "call", "conditional"):
                continue
            # An asynchronous fusion (a layer's slice of the stacked weights copied while the
            # previous layer computes) costs what it moves, as the simulator prices it.
            if not (program.is_compute(instr) or instr.opcode == "fusion-start"):
                continue
            rows.append(_row(program, comp, instr, count, device))
    return rows


def _row(program: Program, comp: Computation, instr: Instr, count: int,
         device: DeviceSpec) -> OpCost:
    category, phase = categorize(program, instr)
    return OpCost(name=instr.name, computation=comp.name, opcode=instr.opcode,
                  category=category, phase=phase, calls=count,
                  flops=program.instr_flops(comp, instr),
                  bytes=program.traffic_bytes(comp, instr),
                  seconds=roofline_time(program, comp, instr, device))


def summarize(rows: Iterable[OpCost], top: int = 10) -> dict:
    """Totals for GEMMs (attention kernels included) and for everything else, the non-GEMM
    totals by category, and the `top` non-GEMM ops by time."""
    rows = list(rows)

    def totals(rs: list[OpCost]) -> dict:
        return {"ops": len(rs), "calls": sum(r.calls for r in rs),
                "bytes": sum(r.total_bytes for r in rs),
                "flops": sum(r.calls * r.flops for r in rs),
                "seconds": sum(r.total_s for r in rs)}

    other = [r for r in rows if not r.gemm]
    by_cat: dict[str, list[OpCost]] = collections.defaultdict(list)
    for r in other:
        by_cat[r.category].append(r)
    cats = {c: totals(rs) for c, rs in sorted(by_cat.items(), key=lambda kv: -totals(kv[1])
                                               ["seconds"])}
    return {"gemm": totals([r for r in rows if r.gemm]), "non_gemm": totals(other),
            "non_gemm_by_category": cats,
            "top_non_gemm": [r.to_json() for r in sorted(other, key=lambda r: -r.total_s)[:top]]}


def format_summary(s: dict) -> str:
    """The account as text: GEMM and non-GEMM totals, the categories, the largest ops."""
    g, o = s["gemm"], s["non_gemm"]
    step = g["seconds"] + o["seconds"]
    lines = [
        f"compute by roofline: {step * 1e3:.2f} ms = GEMMs and attention kernels "
        f"{g['seconds'] * 1e3:.2f} ms ({g['flops'] / 1e12:.2f} TFLOP, "
        f"{g['bytes'] / 2**30:.1f} GiB) + other ops {o['seconds'] * 1e3:.2f} ms "
        f"({o['bytes'] / 2**30:.1f} GiB moved, {o['calls']} launches)",
        f"  {'non-GEMM by what it belongs to':<34}{'ms':>9}{'GiB':>9}{'launches':>10}",
    ]
    for cat, t in s["non_gemm_by_category"].items():
        lines.append(f"  {cat:<34}{t['seconds'] * 1e3:>9.2f}{t['bytes'] / 2**30:>9.2f}"
                     f"{t['calls']:>10}")
    lines.append(f"  {'largest non-GEMM ops':<34}{'ms':>9}{'GiB':>9}{'calls':>10}  phase")
    for r in s["top_non_gemm"]:
        label = f"{r['category']}: {r['name']}"[:33]
        lines.append(f"  {label:<34}{r['total_s'] * 1e3:>9.2f}{r['total_bytes'] / 2**30:>9.2f}"
                     f"{r['calls']:>10}  {r['phase']}")
    return "\n".join(lines)
