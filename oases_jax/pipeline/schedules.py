"""Pipeline schedules as pure functions of (S stages, M micro-batches, options) -> `Schedule`,
all with one signature: `build(stages, microbatches, *, chunks=1, recompute=...)`.

GPipe, 1F1B, Megatron's interleaved 1F1B, Merak's shifted critical path and ZB-H1. Each builds
the per-stage order of forwards and backwards first, then says which micro-batches recompute and
where. Their records (executor, capabilities) are in `oases_jax.pipeline.registry`;
docs/parallelism.md ("Pipeline schedules") has each one's table and formulas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from oases_jax.errors import UserError
from oases_jax.pipeline.actions import Action, wire
from oases_jax.pipeline.table import Schedule

Order = list[tuple[str, int, int]]  # (F or B, micro-batch, chunk), one stage's compute order


def _check(name: str, stages: int, microbatches: int, needs_m_ge_s: bool) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise UserError(f"pipeline stages S={stages!r} must be a positive integer")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise UserError(f"micro-batches M={microbatches!r} must be a positive integer")
    if needs_m_ge_s and microbatches < stages:
        raise UserError(f"the {name} schedule needs at least as many micro-batches as stages, "
                        f"got M={microbatches} for S={stages}: use M >= {stages} micro-batches "
                        f"(or 1f1b / gpipe, which run any M)")


def _one_chunk(name: str, chunks: int) -> None:
    if chunks != 1:
        raise UserError(f"the {name} schedule holds one model chunk per stage, got chunks="
                        f"{chunks!r}: use chunks=1 (or the interleaved schedule)")


def _flags(recompute: bool | Sequence[bool], stages: int) -> tuple[bool, ...]:
    """One recompute flag per stage from one flag or a per-stage list."""
    if isinstance(recompute, bool):
        return (recompute,) * stages
    flags = tuple(bool(r) for r in recompute)
    if len(flags) != stages:
        raise UserError(f"recompute has {len(flags)} per-stage flags for S={stages} stages: "
                        f"give one per stage, or one flag for all")
    return flags


def _expand(order: Order, recompute: bool, hoisted: frozenset[int] = frozenset()) -> list[Action]:
    """Actions from a compute order: a hoisted micro-batch runs PF, then RrG just before its B
    (so the recompute runs as soon as the stage is free, before the gradient arrives); otherwise
    a recomputing stage runs R just before B (after the gradient, like remat inside B)."""
    out = []
    for kind, mb, chunk in order:
        if kind == "F":
            out.append(Action("PF" if mb in hoisted else "F", mb, chunk))
            continue
        if mb in hoisted:
            out.append(Action("RrG", mb, chunk))
        elif recompute:
            out.append(Action("R", mb, chunk))
        out.append(Action("B", mb, chunk))
    return out


def _schedule(name: str, stages: int, microbatches: int, chunks: int,
              actions: Sequence[list[Action]]) -> Schedule:
    return Schedule(name, stages, microbatches, chunks, wire(actions, chunks))


def _order_1f1b(stages: int, microbatches: int, s: int) -> Order:
    """1F1B on stage s: S-1-s warm-up forwards, then one forward and one backward in turn, then
    the remaining backwards. At most S-s micro-batches are in flight on stage s."""
    warm = min(stages - 1 - s, microbatches)
    order = [("F", m, 0) for m in range(warm)]
    for i in range(microbatches - warm):
        order += [("F", warm + i, 0), ("B", i, 0)]
    return order + [("B", m, 0) for m in range(microbatches - warm, microbatches)]


def gpipe(stages: int, microbatches: int, *, chunks: int = 1,
          recompute: bool | Sequence[bool] = False) -> Schedule:
    """GPipe: every forward, then every backward in reverse micro-batch order (the order
    autodiff of a forward loop gives). Bubble (S-1)/(M+S-1); holds all M micro-batches."""
    _one_chunk("gpipe", chunks)
    _check("gpipe", stages, microbatches, False)
    flags = _flags(recompute, stages)
    fwd = [("F", m, 0) for m in range(microbatches)]
    bwd = [("B", m, 0) for m in reversed(range(microbatches))]
    return _schedule("gpipe", stages, microbatches, 1,
                     [_expand(fwd + bwd, flags[s]) for s in range(stages)])


def gpipe_spmd(stages: int, microbatches: int, *, chunks: int = 1,
               recompute: bool | Sequence[bool] = False) -> Schedule:
    """GPipe's table, run by `training.pipeline_spmd` rather than the tick executor: every
    device runs the same program every tick (no switch), so a stage may hold collectives over
    its tensor group of any kind (ring permutes included); bubble ticks compute on values
    nobody reads. Same bubble and memory as GPipe."""
    table = gpipe(stages, microbatches, chunks=chunks, recompute=recompute)
    return dataclasses.replace(table, name="gpipe_spmd")


def one_f_one_b_spmd(stages: int, microbatches: int, *, chunks: int = 1,
                     recompute: bool | Sequence[bool] = True) -> Schedule:
    """1F1B run by `training.pipeline_spmd.spmd_1f1b_grads` with no per-stage control flow: in
    lockstep tick t stage s runs F of micro-batch t-s, then B of micro-batch t-(2S-2-s), so
    the last stage alternates F and B from its first tick and stage s runs 2(S-1-s)+1
    forwards before its first backward (about twice 1F1B's warm-up: its B waits for the
    gradient's walk back down), at most 2(S-1-s)+1 micro-batches in flight. Every B
    recomputes its stage's forward first (R): the executor keeps only the stage's inputs.
    Any M >= 1."""
    _one_chunk("1f1b_spmd", chunks)
    _check("1f1b_spmd", stages, microbatches, False)
    flags = _flags(recompute, stages)
    orders = []
    for s in range(stages):
        order = []
        for t in range(microbatches + 2 * stages - 2):
            if 0 <= t - s < microbatches:
                order.append(("F", t - s, 0))
            if 0 <= t - (2 * stages - 2 - s) < microbatches:
                order.append(("B", t - (2 * stages - 2 - s), 0))
        orders.append(_expand(order, flags[s]))
    return _schedule("1f1b_spmd", stages, microbatches, 1, orders)


def one_f_one_b(stages: int, microbatches: int, *, chunks: int = 1,
                recompute: bool | Sequence[bool] = False) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's default): GPipe's bubble (S-1)/(M+S-1) with at most
    S-s micro-batches in flight on stage s. Any M >= 1 runs (M < S is all warm-up)."""
    _one_chunk("1f1b", chunks)
    _check("1f1b", stages, microbatches, False)
    flags = _flags(recompute, stages)
    return _schedule("1f1b", stages, microbatches, 1,
                     [_expand(_order_1f1b(stages, microbatches, s), flags[s])
                      for s in range(stages)])


def _order_interleaved(stages: int, microbatches: int, chunks: int, s: int) -> Order:
    """Megatron's interleaved order: micro-batches in groups of S, each group run through chunk
    0, 1, ..., v-1; backwards in the same order with the chunks reversed; 2(S-1-s) + (v-1)S
    warm-up forwards, then one forward and one backward in turn. (With M not a multiple of S,
    Megatron-core's larger last group deadlocks under this warm-up: S=4, M=5, v=3.)"""
    table = [(m, c) for lo in range(0, microbatches, stages) for c in range(chunks)
             for m in range(lo, lo + stages)]
    fwd = [("F", m, c) for m, c in table]
    bwd = [("B", m, chunks - 1 - c) for m, c in table]
    total = len(table)
    warm = min(2 * (stages - 1 - s) + (chunks - 1) * stages, total)
    order = fwd[:warm]
    for i in range(total - warm):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[total - warm:]


def interleaved(stages: int, microbatches: int, *, chunks: int = 2,
                recompute: bool | Sequence[bool] = False) -> Schedule:
    """Megatron's interleaved 1F1B: device s holds v chunks, virtual stages s, s+S, ...,
    s+(v-1)S. Bubble (S-1)/(v*M+S-1); needs M a multiple of S, S >= 2 and v >= 2 (and each
    stage's layers divisible by v: `remat.resolve_stage_layers(..., chunks=v)`); v times the
    transfers of 1F1B, and a wrap-around edge (device S-1 -> 0) between chunks."""
    v = chunks
    if not isinstance(v, int) or v < 2:
        raise UserError(f"interleaved needs v >= 2 chunks per stage, got v={v!r}: use v >= 2 "
                        f"(v=1 is the 1f1b schedule)")
    _check("interleaved", stages, microbatches, True)
    if microbatches % stages:
        lower = stages * (microbatches // stages)
        raise UserError(f"interleaved runs micro-batches in groups of S={stages}, so M must be a "
                        f"multiple of S, got M={microbatches}: use M = {lower} or "
                        f"{lower + stages}")
    if stages < 2:
        raise UserError(f"interleaved needs S >= 2 stages to interleave chunks, got S={stages}: "
                        f"use 1f1b for a single stage")
    flags = _flags(recompute, stages)
    return _schedule("interleaved", stages, microbatches, v,
                     [_expand(_order_interleaved(stages, microbatches, v, s), flags[s])
                      for s in range(stages)])


def _merak_hoisted(stages: int, microbatches: int, s: int) -> frozenset[int]:
    """Micro-batches stage s runs as PF + RrG. Cool-down: on stages s <= S-3 the last S-1-s
    (M - mb + s < S). Warm-up: stage S-2 its first two, stage S-3 its first. Stage S-2's last
    micro-batch stays F + R (as Merak's generator emits it): its gradient is already there when
    its backward slot comes, so hoisting would gain nothing."""
    last = stages - 1
    hoisted = set()
    if s <= last - 2:
        hoisted |= set(range(max(0, microbatches - (last - s)), microbatches))
    if s == last - 1:
        hoisted |= {0, 1}
    if s == last - 2:
        hoisted.add(0)
    return frozenset(m for m in hoisted if m < microbatches)


def merak(stages: int, microbatches: int, *, chunks: int = 1, recompute: bool = True
          ) -> Schedule:
    """Merak's shifted critical path (`full_critical_path_1f1b`) on 1F1B with full recompute:
    the last stage never recomputes (its B follows its F); the recomputation of each non-last
    stage's final micro-batches is hoisted (PF, then RrG) into the cool-down bubble before their
    gradient arrives; stage S-2 runs its third forward in its first backward slot, hoisting the
    recompute of its first two micro-batches, and stage S-3 hoists its first. Needs M >= S
    (Merak's generator also asserts M >= 4; this one validates for every M >= S, S=2 included).
    Its recompute is its own placement: `recompute` must stay True."""
    _one_chunk("merak", chunks)
    if recompute is not True:
        raise UserError(f"the merak schedule places its own recompute (the shifted critical "
                        f"path), got recompute={recompute!r}: use 1f1b for other recompute")
    _check("merak", stages, microbatches, True)
    actions = []
    for s in range(stages):
        order = _order_1f1b(stages, microbatches, s)
        if s == stages - 2 and microbatches >= 3:  # B0 <-> F2: the first backward slot runs F2
            i, k = order.index(("B", 0, 0)), order.index(("F", 2, 0))
            order[i], order[k] = order[k], order[i]
        actions.append(_expand(order, s < stages - 1, _merak_hoisted(stages, microbatches, s)))
    return _schedule("merak", stages, microbatches, 1, actions)


def zb_h1(stages: int, microbatches: int, *, chunks: int = 1, recompute: bool = False
          ) -> Schedule:
    """ZB-H1 (Qi et al., ICLR'24): 1F1B with each backward split into B (input gradient, on the
    critical path) and W (weight gradient, deferred). Stage s runs the W of micro-batch i after
    the B of micro-batch i + S-1-s, filling the cool-down bubble with W; memory as 1F1B. Bubble
    (S-1)(F+B-2W) per stage against 1F1B's (S-1)(F+B), B the whole backward. Needs M >= S; no
    recompute."""
    _one_chunk("zb_h1", chunks)
    if recompute:
        raise UserError("the zb_h1 schedule does not recompute: use recompute=False")
    _check("zb_h1", stages, microbatches, True)
    actions = []
    for s in range(stages):
        lag = s
        acts, ws = [], 0
        for kind, mb, _ in _order_1f1b(stages, microbatches, s):
            acts.append(Action(kind, mb))
            if kind == "B" and mb >= lag:
                acts.append(Action("W", ws))
                ws += 1
        acts += [Action("W", m) for m in range(ws, microbatches)]
        actions.append(acts)
    return _schedule("zb_h1", stages, microbatches, 1, actions)
