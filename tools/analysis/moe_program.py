"""What an MoE program's collectives do, read from the scheduled HLO: the MoE path's collectives
by kind and mesh axis (per-layer all-to-all bytes over `expert`, the ESP all-gather and
reduce-scatter bytes over `tensor`), and for Parm's S2 whether each capacity chunk's ESP
all-gather runs while the next chunk's all-to-all is in flight (docs/parallelism.md, "Mixture
of experts"; docs/inspection.md, "MoE programs").

Chunks are told apart by data flow, not by names: a chunk's all-gather is the one whose nearest
upstream collective is that chunk's all-to-all alone. Chunks are ordered by when their
all-to-all completes in the schedule (XLA is free to issue independent chunks in any order).
"""

from __future__ import annotations

import collections
import dataclasses

from oases_jax.tools.analysis.program import Collective, Program

EP_AXIS, MP_AXIS = "expert", "tensor"


@dataclasses.dataclass(frozen=True)
class Span:
    """One collective in its computation's schedule: [start, done] instruction positions (equal
    for a synchronous op), asynchronous or not."""

    collective: Collective
    start: int
    done: int

    @property
    def is_async(self) -> bool:
        return self.collective.is_async

    def overlaps(self, other: Span) -> bool:
        """Both in flight at once: asynchronous, and each starts before the other is done."""
        return (self.is_async and other.is_async and self.start < other.done
                and other.start < self.done)


@dataclasses.dataclass(frozen=True)
class ChunkPipeline:
    """The chunks of one collective pipeline in one computation (a layer's forward or
    backward): stage `first` (e.g. the dispatch all-to-all) feeding stage `second` (the ESP
    all-gather), chunks in the order their first stage completes. `overlapped[i]`: chunk i's
    second stage is in flight together with chunk i+1's first stage."""

    computation: str
    first: str  # "all-to-all@expert"
    second: str  # "all-gather@tensor"
    chunks: tuple[tuple[Span, Span], ...]

    @property
    def overlapped(self) -> tuple[bool, ...]:
        return tuple(self.chunks[i][1].overlaps(self.chunks[i + 1][0])
                     for i in range(len(self.chunks) - 1))

    def to_json(self) -> dict:
        return {"computation": self.computation, "first": self.first, "second": self.second,
                "chunks": len(self.chunks), "overlapped": list(self.overlapped),
                "spans": [[[a.collective.name, a.start, a.done, a.is_async],
                           [b.collective.name, b.start, b.done, b.is_async]]
                          for a, b in self.chunks]}


def _key(c: Collective) -> str:
    return f"{c.kind}@{'+'.join(c.axes)}"


def spans(program: Program, comp_name: str) -> dict[str, Span]:
    """Every collective of one computation with its schedule span, by instruction name."""
    comp = program.comp(comp_name)
    index = {i.name: n for n, i in enumerate(comp.instrs)}
    dones = {i.operands[0]: n for n, i in enumerate(comp.instrs)
             if i.opcode.endswith("-done") and i.operands}
    return {c.name: Span(c, index[c.name], dones.get(c.name, index[c.name]))
            for c in program.collectives() if c.computation == comp_name}


def upstream_collectives(program: Program, comp_name: str, instr_name: str,
                         names: set[str]) -> set[str]:
    """The nearest collectives (of `names`) that instruction `instr_name` depends on inside its
    computation: the walk up its operands stops at each collective it reaches."""
    comp = program.comp(comp_name)
    out, seen = set(), set()
    stack = list(comp.by_name[instr_name].operands)
    while stack:
        name = stack.pop()
        if name in seen or name not in comp.by_name:
            continue
        seen.add(name)
        instr = comp.by_name[name]
        if instr.opcode.endswith("-done") and instr.operands and instr.operands[0] in names:
            out.add(instr.operands[0])
        elif name in names:
            out.add(name)
        else:
            stack.extend(instr.operands)
    return out


def pipelines(program: Program, first: str = f"all-to-all@{EP_AXIS}",
              second: str = f"all-gather@{MP_AXIS}", min_bytes: int = 1024
              ) -> list[ChunkPipeline]:
    """In every computation that holds both, the (first -> second) chunk pairs: each `second`
    collective whose nearest upstream collectives are exactly one `first` collective. Only
    computations with two or more such pairs are chunk pipelines; collectives under
    `min_bytes` (router statistics) are left out."""
    out = []
    comps = collections.OrderedDict.fromkeys(c.computation for c in program.collectives())
    for comp_name in comps:
        sp = {n: s for n, s in spans(program, comp_name).items()
              if s.collective.bytes >= min_bytes}
        names = set(sp)
        pairs = []
        for name, s in sp.items():
            if _key(s.collective) != second:
                continue
            up = upstream_collectives(program, comp_name, name, names)
            if len(up) == 1 and _key(sp[next(iter(up))].collective) == first:
                pairs.append((sp[next(iter(up))], s))
        if len(pairs) >= 2:
            pairs.sort(key=lambda p: (p[0].done, p[0].start))
            out.append(ChunkPipeline(comp_name, first, second, tuple(pairs)))
    return out


def moe_collectives(program: Program, ep_axis: str = EP_AXIS, mp_axis: str = MP_AXIS,
                    min_bytes: int = 1024) -> dict[str, dict]:
    """The collectives over the expert axis and the ESP collectives, by `kind@axes`: count,
    bytes per program run (loop trip counts included) and the distinct per-device sizes. The
    ESP all-gathers are those over `mp_axis` whose nearest upstream collective is one
    all-to-all over `ep_axis` and nothing else and that feed a reduce-scatter over `mp_axis`
    (through the expert FFN) whose nearest upstream collectives are such all-gathers only: the
    ESP reduce-scatters. The other collectives over `mp_axis` belong to attention and the
    residual stream (S1's restore all-gather waits for every chunk's all-to-all back and for
    attention). Where XLA's combiners merged chunks' all-gathers, the merged one has several
    upstream all-to-alls and is not counted as ESP."""
    out: dict[str, dict] = {}
    esp = set()
    for comp_name in collections.OrderedDict.fromkeys(c.computation
                                                      for c in program.collectives()):
        sp = {n: s for n, s in spans(program, comp_name).items()
              if s.collective.bytes >= min_bytes}
        names = set(sp)
        a2a = {n for n, s in sp.items()
               if s.collective.kind == "all-to-all" and ep_axis in s.collective.axes}
        ups = {n: upstream_collectives(program, comp_name, n, names) for n, s in sp.items()
               if s.collective.axes == (mp_axis,)}
        gathers = {n for n, up in ups.items() if sp[n].collective.kind == "all-gather"
                   and len(up) == 1 and up <= a2a}
        for n, up in ups.items():  # fed by the ESP all-gathers only, through the expert FFN
            if sp[n].collective.kind == "reduce-scatter" and up and up <= gathers:
                esp |= {(comp_name, n)} | {(comp_name, g) for g in up}
    for c in program.collectives():
        if c.bytes < min_bytes:
            continue
        if c.kind == "all-to-all" and ep_axis in c.axes:
            key = f"{c.kind}@{'+'.join(c.axes)}"
        elif (c.computation, c.name) in esp:
            key = f"esp-{c.kind}@{'+'.join(c.axes)}"
        else:
            continue
        row = out.setdefault(key, {"count": 0, "bytes": 0, "sizes": set()})
        row["count"] += c.count
        row["bytes"] += c.bytes * c.count
        row["sizes"].add(c.bytes)
    for row in out.values():
        row["sizes"] = sorted(row["sizes"])
    return out


def report(program: Program, n_moe_layers: int) -> dict:
    """The MoE part of an inspection report (`tools.inspection`): the MoE collectives per step
    and per MoE layer (forward, backward and any recompute together), and the chunk pipelines
    of parm_s2, dispatch side (chunk i's ESP all-gather beside chunk i+1's all-to-all) and
    combine side (chunk i's all-to-all back beside chunk i+1's ESP reduce-scatter)."""
    colls = moe_collectives(program)
    n = max(1, n_moe_layers)
    return {
        "n_moe_layers": n_moe_layers,
        "collectives": colls,
        "per_layer_bytes": {k: v["bytes"] / n for k, v in colls.items()},
        "dispatch_pipelines": [p.to_json() for p in pipelines(program)],
        "combine_pipelines": [p.to_json() for p in pipelines(
            program, f"reduce-scatter@{MP_AXIS}", f"all-to-all@{EP_AXIS}")],
    }
