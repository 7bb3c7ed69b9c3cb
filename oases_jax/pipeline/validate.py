"""Offline validator of a pipeline schedule: the oracle an executor's program is checked against.

A schedule is valid when every (micro-batch, virtual stage) has exactly one forward and one B
(and one W when the backward is split), each recompute belongs to its forward (R after an F,
RrG after a PF), each stage runs forward < recompute < B < W, every action carries exactly the
transfers its kind implies, and the lists run to the end on unit ticks (no deadlock), with every
forward before the next stage's, every B after the next stage's and every transfer read once,
after it was sent.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from oases_jax.pipeline.actions import FORWARDS, InvalidSchedule, vstage, wire
from oases_jax.pipeline.table import Schedule, TickTable

_MAX_LISTED = 6  # problems named in one error


@dataclasses.dataclass(frozen=True)
class Report:
    """What a valid schedule holds: per stage, the most (micro-batch, chunk) inputs kept for a
    backward at once (`peak_inflight`) and the most kept with all their activations
    (`peak_live`: from a forward that is not recomputed, or from the recompute, to the B/W)."""

    table: TickTable
    peak_inflight: tuple[int, ...]
    peak_live: tuple[int, ...]


def inflight(schedule: Schedule, table: TickTable | None = None
             ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(peak_inflight, peak_live) per stage, counted along each stage's order (its list, or
    the rows of `table`, which a fused table fills in the list's order): a micro-
    batch's chunk is held from its forward until its backward is complete (B, or W when
    split)."""
    S = schedule.stages
    recomputed = schedule.recomputed()
    last = "W" if schedule.split_backward else "B"
    peaks_in, peaks_live = [], []
    orders = schedule.actions if table is None else [
        [row[s] for row in table.ticks if row[s].kind != "IDLE"] for s in range(S)]
    for s, acts in enumerate(orders):
        held: set[tuple[int, int]] = set()
        live: set[tuple[int, int]] = set()
        peak_in = peak_live = 0
        for a in acts:
            key = (a.mb, vstage(s, a, S))
            if a.kind in FORWARDS:
                held.add(key)
                if key not in recomputed:
                    live.add(key)
            elif a.kind in ("R", "RrG"):
                live.add(key)
            peak_in, peak_live = max(peak_in, len(held)), max(peak_live, len(live))
            if a.kind == last:
                held.discard(key)
                live.discard(key)
        peaks_in.append(peak_in)
        peaks_live.append(peak_live)
    return tuple(peaks_in), tuple(peaks_live)


def _structure(schedule: Schedule) -> list[str]:
    """Problems visible in the lists alone: counts, pairing, same-stage order, transfers."""
    S, M, v = schedule.stages, schedule.microbatches, schedule.chunks
    if len(schedule.actions) != S:
        return [f"{len(schedule.actions)} action lists for S={S} stages"]
    problems = []
    seen: Counter = Counter()
    where: dict[tuple[str, int, int], int] = {}  # (kind, mb, j) -> index in its stage's list
    for s, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.kind == "IDLE" or not (0 <= a.mb < M and 0 <= a.chunk < v):
                problems.append(f"stage {s} position {i} holds {a.label(v)} (chunk {a.chunk}): "
                                f"lists hold work on micro-batches 0..{M - 1}, chunks 0..{v - 1}")
                continue
            key = (a.kind, a.mb, vstage(s, a, S))
            seen[key] += 1
            where[key] = i
    split = schedule.split_backward
    for mb in range(M):
        for j in range(schedule.virtual):
            problems += _pairing(seen, where, mb, j, split, f"mb {mb} on virtual stage {j} "
                                 f"(stage {j % S})")
    wired = wire(schedule.actions, v)
    for s, (acts, want) in enumerate(zip(schedule.actions, wired, strict=True)):
        for a, w in zip(acts, want, strict=True):
            if (a.recvs, a.sends) != (w.recvs, w.sends):
                problems.append(f"stage {s} {a.label(v)} carries recvs {_xs(a.recvs)} sends "
                                f"{_xs(a.sends)}, but its kind implies {_xs(w.recvs)} / "
                                f"{_xs(w.sends)}")
    return problems


def _xs(transfers) -> str:
    return "[" + ", ".join(map(str, transfers)) + "]"


def _pairing(seen: Counter, where: dict, mb: int, j: int, split: bool, name: str) -> list[str]:
    problems = []
    for kind, want in (("F", None), ("PF", None), ("B", 1), ("W", 1 if split else 0),
                       ("R", None), ("RrG", None)):
        if want is not None and seen[(kind, mb, j)] != want:
            problems.append(f"{name} has {seen[(kind, mb, j)]} {kind}, needs {want}")
    forwards = seen[("F", mb, j)] + seen[("PF", mb, j)]
    if forwards != 1:
        problems.append(f"{name} has {forwards} forwards (F or PF), needs 1")
    if seen[("PF", mb, j)] != seen[("RrG", mb, j)] or seen[("R", mb, j)] > seen[("F", mb, j)]:
        problems.append(f"{name}: a PF needs an RrG and an R needs an F (got F "
                        f"{seen[('F', mb, j)]}, PF {seen[('PF', mb, j)]}, R {seen[('R', mb, j)]},"
                        f" RrG {seen[('RrG', mb, j)]})")
    chain = [k for k in ("F", "PF", "R", "RrG", "B", "W") if (k, mb, j) in where]
    pos = [where[(k, mb, j)] for k in chain]
    if pos != sorted(pos):
        order = " ".join(f"{k}@{p}" for k, p in zip(chain, pos, strict=True))
        problems.append(f"{name} runs out of order on its stage ({order}): a stage runs "
                        f"forward, recompute, B, W of a micro-batch in that order")
    return problems


def _timing(table: TickTable) -> list[str]:
    """Problems of the placed table: cross-stage order and transfer pairing."""
    sch = table.schedule
    S, V = sch.stages, sch.virtual
    tick = {}
    for t, row in enumerate(table.ticks):
        for s, a in enumerate(row):
            if a.kind != "IDLE":
                tick[(a.kind if a.kind not in FORWARDS else "F", a.mb, vstage(s, a, S))] = t
    problems = []
    for (kind, mb, j), t in tick.items():
        if kind == "F" and j + 1 < V and not t < tick[("F", mb, j + 1)]:
            problems.append(f"forward of mb {mb} on virtual stage {j + 1} is not after {j}'s")
        if kind == "B" and j + 1 < V and not t > tick[("B", mb, j + 1)]:
            problems.append(f"B of mb {mb} on virtual stage {j} is not after {j + 1}'s")
    sent = Counter(x for row in table.transfers for x in row)
    when = {x: t for t, row in enumerate(table.transfers) for x in row}
    for x, n in sent.items():
        if n != 1 or x not in table.consumed:
            problems.append(f"transfer {x} is sent {n} time(s) and read "
                            f"{'once' if x in table.consumed else 'never'}")
        elif not table.consumed[x] > when[x]:
            problems.append(f"transfer {x} is read at tick {table.consumed[x]}, before it is sent"
                            f" after tick {when[x]}")
    problems += [f"transfer {x} is read but never sent" for x in table.consumed if x not in sent]
    return problems


def validate(schedule: Schedule) -> Report:
    """Check `schedule` (see the module docstring); raise InvalidSchedule naming what is wrong,
    else return its tick table and in-flight counts."""
    problems = _structure(schedule)
    if not problems:
        table = schedule.ticks()  # raises on a deadlock, naming the stuck actions
        problems = _timing(table)
    if problems:
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise InvalidSchedule(f"invalid {schedule.name} schedule (S={schedule.stages}, "
                              f"M={schedule.microbatches}): " + "; ".join(
                                  problems[:_MAX_LISTED]) + more)
    peak_in, peak_live = inflight(schedule)
    return Report(table, peak_in, peak_live)
