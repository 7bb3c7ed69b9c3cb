"""What a compiled program does: its collectives (bytes, mesh axes, sync/async, what runs inside
each async window), FLOPs, memory and op counts, read from the scheduled HLO."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

import numpy as np

from oases_jax.tools.analysis.attention import fused_attention_flops, is_fused_attention
from oases_jax.tools.analysis.hlo import (
    COLLECTIVES,
    Computation,
    HloModule,
    Instr,
    parse_module,
    replica_groups,
    source_target_pairs,
)

# Instructions that move no data and do no arithmetic.
TRIVIAL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain",
})
# A fusion parameter used only through these reads what they return, not the whole operand.
SLICES = ("slice", "dynamic-slice")
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas", re.I)


def collective_kind(instr: Instr, module: HloModule) -> str | None:
    """The collective an instruction starts or is (None for anything else)."""
    op = instr.opcode.removesuffix("-start")
    if op in COLLECTIVES:
        return op
    if instr.opcode == "async-start":
        root = module.computations[instr.called[0]].root if instr.called else None
        if root is not None and root.opcode in COLLECTIVES:
            return root.opcode
    return None


def is_async_start(instr: Instr) -> bool:
    return instr.opcode.endswith("-start") and instr.opcode != "copy-start"


@dataclasses.dataclass
class Collective:
    name: str
    computation: str
    kind: str
    bytes: int  # per device: gathered output for all-gather, input for the others
    group_size: int
    groups: list[list[int]]  # device groups (for permutes: the (source, target) pairs)
    axes: tuple[str, ...]  # mesh axes the groups span
    is_async: bool
    count: int  # executions per program run (loop trip counts multiplied in)
    window: list[str] = dataclasses.field(default_factory=list)  # ops between start and done
    window_gemms: int = 0
    window_compute: int = 0

    @property
    def overlapped(self) -> bool:
        return self.is_async and self.window_compute > 0

    @property
    def gemm_overlapped(self) -> bool:
        return self.is_async and self.window_gemms > 0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("groups")
        d["window"] = d["window"][:20]
        d["overlapped"], d["gemm_overlapped"] = self.overlapped, self.gemm_overlapped
        return d


class Program:
    """A parsed scheduled HLO module plus the queries the analysis and the simulator share."""

    def __init__(self, text: str, mesh_axes: Sequence[tuple[str, int]] = ()):
        self.text = text
        self.module = parse_module(text)
        self.mesh_axes = tuple(mesh_axes)
        self.num_devices = math.prod(s for _, s in mesh_axes) if mesh_axes else 1
        self._has_gemm: dict[str, bool] = {}
        self._flops: dict[str, float] = {}
        self._collectives: list[Collective] | None = None
        self._by_instr: dict[tuple[str, str], Collective] | None = None

    def comp(self, name: str) -> Computation:
        return self.module.computations[name]

    def shape_of(self, comp: Computation, operand: str) -> int:
        instr = comp.by_name.get(operand)
        return instr.result_bytes if instr else 0

    def operand_bytes(self, comp: Computation, instr: Instr, k: int) -> int:
        """Bytes of `instr`'s k-th operand: the named tuple element where it is `%t#i`."""
        src = comp.by_name.get(instr.operands[k])
        element = instr.elements[k] if k < len(instr.elements) else None
        if src is None:
            return 0
        return src.result_bytes if element is None else src.element_bytes(element)

    def has_gemm(self, comp_name: str) -> bool:
        if comp_name not in self._has_gemm:
            self._has_gemm[comp_name] = any(self.is_gemm(i) for i in self.comp(comp_name).instrs)
        return self._has_gemm[comp_name]

    def is_gemm(self, instr: Instr) -> bool:
        if instr.opcode in ("dot", "convolution"):
            return True
        if instr.opcode == "custom-call":  # cuBLAS GEMMs and cuDNN's fused attention
            return (bool(_GEMM_TARGET.search(instr.attr("custom_call_target") or ""))
                    or is_fused_attention(instr))
        if instr.opcode in ("fusion", "call", "while", "conditional", "async-start"):
            return any(self.has_gemm(c) for c in instr.called if c in self.module.computations)
        return False

    def is_compute(self, instr: Instr) -> bool:
        if instr.opcode in TRIVIAL or collective_kind(instr, self.module):
            return False
        return not (instr.opcode.endswith("-done") or instr.opcode.endswith("-start"))

    def flops_of(self, comp_name: str) -> float:
        if comp_name not in self._flops:
            comp = self.comp(comp_name)
            self._flops[comp_name] = sum(self.instr_flops(comp, i) for i in comp.instrs)
        return self._flops[comp_name]

    def instr_flops(self, comp: Computation, instr: Instr) -> float:
        if instr.opcode == "dot":
            return _dot_flops(instr, comp, instr.attr("lhs_contracting_dims"))
        if is_fused_attention(instr):
            return fused_attention_flops(instr, comp)
        if instr.opcode == "custom-call" and self.is_gemm(instr):
            dims = (instr.backend_config.get("gemm_backend_config", {})
                    .get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions", []))
            return _dot_flops(instr, comp, "{" + ",".join(map(str, dims)) + "}")
        if instr.opcode == "while":
            trips = self.module.trip_count(instr) or 1
            return trips * sum(self.flops_of(c) for c in instr.called)
        if instr.opcode == "conditional":
            return max((self.flops_of(c) for c in instr.called), default=0.0)
        if instr.opcode in ("fusion", "fusion-start", "call", "async-start"):
            return sum(self.flops_of(c) for c in instr.called if c in self.module.computations)
        return 0.0

    def traffic_bytes(self, comp: Computation, instr: Instr) -> int:
        """HBM bytes an op reads and writes. Slices read only what they return, and in-place
        updates write only the update: a loop body that slices one layer out of stacked weights
        reads one layer, not the stack, and an accumulate into part of a buffer (a fusion that
        slices the buffer and updates the same buffer in place, `acc.at[c].add(g)`) reads the
        part it slices."""
        if instr.opcode == "dynamic-slice":
            return 2 * instr.result_bytes
        if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
            return 2 * self.operand_bytes(comp, instr, 1)
        if instr.opcode not in ("fusion", "fusion-start") or not instr.called:
            return instr.result_bytes + sum(self.operand_bytes(comp, instr, k)
                                            for k in range(len(instr.operands)))
        body = self.comp(instr.called[0])
        users: dict[str, list[Instr]] = collections.defaultdict(list)
        for i in body.instrs:
            for o in i.operands:
                users[o].append(i)
        def uses_of(name: str) -> list[Instr]:  # looking through bitcasts
            out = []
            for u in users[name]:
                out += uses_of(u.name) if u.opcode == "bitcast" else [(u, name)]
            return out

        total = 0
        for param in (i for i in body.instrs if i.opcode == "parameter"):
            index = int(param.operand_text or 0)
            full = self.operand_bytes(comp, instr, index) if index < len(instr.operands) else 0
            uses = uses_of(param.name)
            if uses and all(u.opcode in SLICES and u.operands[0] == via for u, via in uses):
                total += sum(u.result_bytes for u, _ in uses)
            elif uses and all(u.opcode in (*SLICES, "dynamic-update-slice")
                              and u.operands[0] == via for u, via in uses):
                # updated in place, read only where sliced
                total += sum(u.result_bytes for u, _ in uses if u.opcode in SLICES)
            else:
                total += full
        root = body.root
        outputs = [body.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
        for out in outputs:
            if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
                total += self.shape_of(body, out.operands[1])
            else:
                total += out.result_bytes
        return total

    def walk(self, comp_name: str | None = None, count: int = 1
             ) -> Iterator[tuple[Computation, int]]:
        """Every control-flow computation reachable from the entry (not fusion bodies), with how
        many times it runs per program execution."""
        comp = self.comp(comp_name or self.module.entry)
        yield comp, count
        for instr in comp.instrs:
            if instr.opcode == "while":
                trips = self.module.trip_count(instr) or 1
                for c in instr.called:
                    yield from self.walk(c, count * trips)
            elif instr.opcode in ("call", "conditional"):
                for c in instr.called:
                    yield from self.walk(c, count)

    def fused_attention_calls(self) -> Iterator[tuple[Computation, Instr, int]]:
        """cuDNN's fused-attention calls, with how many times each runs per program execution."""
        for comp, count in self.walk():
            for instr in comp.instrs:
                if is_fused_attention(instr):
                    yield comp, instr, count

    def axes_of(self, groups: list[list[int]]) -> tuple[str, ...]:
        if not self.mesh_axes:
            return ()
        sizes = [s for _, s in self.mesh_axes]
        varying = set()
        for group in groups:
            coords = np.array([np.unravel_index(d, sizes) for d in group if d < self.num_devices])
            if len(coords):
                varying |= {i for i in range(len(sizes)) if len(set(coords[:, i])) > 1}
        return tuple(self.mesh_axes[i][0] for i in sorted(varying))

    def collectives(self) -> list[Collective]:
        """Every collective of the program (computed once)."""
        if self._collectives is None:
            self._collectives = self._find_collectives()
        return self._collectives

    def collective_at(self, comp_name: str, instr_name: str) -> Collective:
        """The collective that instruction `instr_name` of `comp_name` starts or is."""
        if self._by_instr is None:
            self._by_instr = {(c.computation, c.name): c for c in self.collectives()}
        return self._by_instr[(comp_name, instr_name)]

    def _find_collectives(self) -> list[Collective]:
        out = []
        for comp, count in self.walk():
            dones = {i.operands[0]: idx for idx, i in enumerate(comp.instrs)
                     if i.opcode.endswith("-done") and i.operands}
            for idx, instr in enumerate(comp.instrs):
                kind = collective_kind(instr, self.module)
                if kind is None:
                    continue
                out.append(self._collective(comp, idx, instr, kind, count, dones.get(instr.name)))
        return out

    def _collective(self, comp, idx, instr, kind, count, done_idx) -> Collective:
        in_bytes = sum(self.operand_bytes(comp, instr, k) for k in range(len(instr.operands)))
        out_instr = comp.instrs[done_idx] if done_idx is not None else instr
        out_bytes = out_instr.result_bytes
        if kind == "collective-permute":
            pairs = source_target_pairs(instr) or source_target_pairs(
                self._wrapped_root(instr) or instr)
            groups = [list(p) for p in pairs]
            size = 2 if pairs else 1
        else:
            groups = replica_groups(self._wrapped_root(instr) or instr, self.num_devices)
            size = len(groups[0]) if groups else 1
        c = Collective(
            name=instr.name, computation=comp.name, kind=kind,
            bytes=out_bytes if kind == "all-gather" else in_bytes, group_size=size,
            groups=groups, axes=self.axes_of(groups), count=count,
            is_async=done_idx is not None and not instr.backend_config.get(
                "collective_backend_config", {}).get("is_sync", False),
        )
        if done_idx is not None:
            for w in comp.instrs[idx + 1 : done_idx]:
                c.window.append(w.name)
                c.window_gemms += self.is_gemm(w)
                c.window_compute += self.is_compute(w) and not w.opcode.endswith("-done")
        return c

    def _wrapped_root(self, instr: Instr) -> Instr | None:
        if instr.opcode == "async-start" and instr.called:
            return self.comp(instr.called[0]).root
        return None


def _dot_flops(instr: Instr, comp: Computation, contracting: str | None) -> float:
    out = math.prod(instr.shapes[0].dims) if instr.shapes else 0
    lhs = comp.by_name.get(instr.operands[0]) if instr.operands else None
    k = 1
    if lhs is not None and lhs.shapes and contracting:
        dims = lhs.shapes[0].dims
        k = math.prod(dims[int(d)] for d in re.findall(r"\d+", contracting) if int(d) < len(dims))
    return 2.0 * out * k


@dataclasses.dataclass
class Analysis:
    collectives: list[Collective]
    flops: float  # per device per program run
    memory: dict[str, int]
    op_counts: dict[str, int]

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.get("peak_bytes", 0)

    def collective_bytes(self, kinds: Sequence[str] | None = None) -> float:
        return sum(c.bytes * c.count for c in self.collectives if kinds is None or c.kind in kinds)

    def overlap_share(self, *, require: str = "compute", kinds: Sequence[str] | None = None,
                      axes: Sequence[str] | None = None) -> float:
        """Bytes-weighted share of collectives that are async with compute (or, with
        require='gemm', a GEMM) inside their window. 1.0 when there are no collectives."""
        sel = [c for c in self.collectives if (kinds is None or c.kind in kinds)
               and (axes is None or set(c.axes) & set(axes))]
        total = sum(c.bytes * c.count for c in sel)
        if not total:
            return 1.0
        ok = sum(c.bytes * c.count for c in sel
                 if (c.gemm_overlapped if require == "gemm" else c.overlapped))
        return ok / total

    def counts_by_kind(self) -> dict[str, int]:
        counts = collections.Counter()
        for c in self.collectives:
            counts[c.kind] += c.count
        return dict(counts)


def memory_of(compiled) -> dict[str, int]:
    """Per-device memory from `compiled.memory_analysis()`:
    peak = arguments + outputs - aliased + temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    mem = {k: int(getattr(stats, f"{k}_size_in_bytes", 0)) for k in
           ("argument", "output", "alias", "temp", "generated_code")}
    mem["peak_bytes"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    return mem


def analyze_text(text: str, mesh_axes: Sequence[tuple[str, int]] = (),
                 memory: dict[str, int] | None = None) -> tuple[Analysis, Program]:
    program = Program(text, mesh_axes)
    op_counts = collections.Counter()
    for comp, count in program.walk():
        for instr in comp.instrs:
            op_counts[instr.opcode] += count
    analysis = Analysis(
        collectives=program.collectives(),
        flops=program.flops_of(program.module.entry),
        memory=memory or {},
        op_counts=dict(op_counts),
    )
    return analysis, program


def analyze(compiled, mesh) -> tuple[Analysis, Program]:
    """Analyse `jit(f).lower(...).compile()` built on `mesh`."""
    axes = tuple(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    return analyze_text(compiled.as_text(), axes, memory_of(compiled))
