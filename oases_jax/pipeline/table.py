"""A pipeline schedule as plain data, and its tick table: the form one SPMD program runs.

A `Schedule` holds each stage's ordered actions. `place` runs those lists as a list scheduler
(every stage does its next action as soon as what it waits for is done); with unit durations
the start times are ticks, and the `TickTable` gives, for each global tick, each stage's action
(or IDLE) and the transfers that happen after the tick. An SPMD executor loops over the ticks,
switches on each stage's op code, and moves the tick's transfers with one ppermute per direction
between ticks.

A fused tick table (`fuse=True`, which the executor runs where it is the faster in lockstep:
`events.fused_by_default`) lets a stage run a short run of its next actions in one tick (lane k
the run's k-th), lane by lane before the tick's transfers, placed by `fuse.cuts` for the
shortest lockstep step. In 1F1B's steady state every stage then runs one forward and one
backward a tick, and in Merak's a recompute, a backward and a forward, so lockstep ticks are as
long on every stage and the SPMD program idles where the event simulator does, rather than
wherever a forward shares a tick with another stage's backward.

A non-circular schedule (GPipe, 1F1B, Merak's, ZB-H1) has no wrap-around edge: activations only
go device s -> s+1 and gradients s -> s-1, so each direction is a shift of S-1 pairs, never a
ring (a ring over `stage` is what XLA's cycle decomposer can zero, openxla/xla#45222). Only
interleaved schedules wrap (device S-1 -> 0 between one chunk and the next, and back).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction

from oases_jax.pipeline import fuse
from oases_jax.pipeline.actions import (
    CODES,
    IDLE,
    RECOMPUTES,
    Action,
    InvalidSchedule,
    Transfer,
    event,
    inputs,
    vstage,
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions of one training step: S stages (devices), M micro-batches, v
    chunks (virtual stages) per device. The builders are in `oases_jax.pipeline.schedules`."""

    name: str
    stages: int
    microbatches: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def virtual(self) -> int:
        return self.stages * self.chunks

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for acts in self.actions for a in acts)

    def recomputed(self) -> set[tuple[int, int]]:
        """(mb, virtual stage) pairs that are recomputed (by R or RrG) before their B."""
        return {(a.mb, vstage(s, a, self.stages)) for s, acts in enumerate(self.actions)
                for a in acts if a.kind in RECOMPUTES}

    def whole(self) -> tuple[bool, ...]:
        """Per virtual stage, whether every micro-batch of it is recomputed (R or RrG from its
        stashed input; every stage but the last under Merak's schedule). Such a stage's R keeps
        the residuals its backward reads: the runtime runs its layers without checkpoints and
        the planner prices its recompute as the whole forward."""
        done = self.recomputed()
        return tuple(all((mb, j) in done for mb in range(self.microbatches))
                     for j in range(self.virtual))

    def ticks(self, backward_ticks: int | Sequence[int] = 1, fuse: bool = False,
              head: bool = False) -> TickTable:
        return tick_table(self, backward_ticks, fuse, head)

    def pretty(self, fuse: bool = False) -> str:
        """One row per stage, one column per tick (see `TickTable.pretty`)."""
        return self.ticks(fuse=fuse).pretty()


Placement = dict[tuple[int, int], tuple[Fraction, Fraction]]  # (stage, index) -> start, finish


def place(schedule: Schedule, duration: Callable[[int, Action], Fraction],
          latency: Callable[[Transfer], Fraction]) -> Placement:
    """Start and finish of every action when each stage runs its list in order, each action as
    soon as its stage is free and its inputs are done (plus `latency` for those that cross a
    link). Raises InvalidSchedule naming the blocked actions when the lists deadlock.

    Which action can run next depends on the lists alone, never on durations, so the order and
    each action's inputs are worked out once per schedule (`_order`, cached) and every call is
    one pass over it: the planner simulates thousands of cost sets per schedule."""
    out: Placement = {}
    free = [Fraction(0)] * schedule.stages
    for s, i, a, deps in _order(schedule):
        start = free[s]
        for producer, link in deps:
            t = out[producer][1] + (latency(link) if link is not None else 0)
            if t > start:
                start = t
        free[s] = start + duration(s, a)
        out[(s, i)] = (start, free[s])
    return out


_ORDERS: dict[int, tuple[Schedule, tuple]] = {}


def _order(schedule: Schedule) -> tuple:
    """(stage, index, action, inputs) of every action in an order where each input comes first;
    an input is ((stage, index) of its producer, the Transfer when it crosses devices)."""
    hit = _ORDERS.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    S, V = schedule.stages, schedule.virtual
    recomputed = schedule.recomputed()
    done: dict[tuple[str, int, int], tuple[int, int]] = {}
    order = []
    nxt = [0] * S
    # A worklist: a stage blocked on an input waits under that input's key and is queued again
    # when it is produced (any order that respects the inputs gives the same placement).
    queue = list(range(S))
    waiting: dict[tuple[str, int, int], list[int]] = {}
    while queue:
        s = queue.pop()
        acts = schedule.actions[s]
        while nxt[s] < len(acts):
            a = acts[nxt[s]]
            j = vstage(s, a, S)
            needs = inputs(a.kind, a.mb, j, V, (a.mb, j) in recomputed)
            missing = next((key for key, _ in needs if key not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(s)
                break
            deps = tuple((done[key], _link(key, j) if remote and key[2] % S != j % S
                          else None) for key, remote in needs)
            key = event(a.kind, a.mb, j)
            if key in done:
                raise InvalidSchedule(f"stage {s} runs {a.label(schedule.chunks)} twice "
                                      f"(or another action produces its {key[0]})")
            done[key] = (s, nxt[s])
            order.append((s, nxt[s], a, deps))
            nxt[s] += 1
            queue.extend(waiting.pop(key, ()))
    if any(nxt[s] < len(acts) for s, acts in enumerate(schedule.actions)):
        raise InvalidSchedule(_deadlock(schedule, nxt, done, recomputed))
    if len(_ORDERS) > 256:
        _ORDERS.clear()
    _ORDERS[id(schedule)] = (schedule, tuple(order))
    return _ORDERS[id(schedule)][1]


def _link(key: tuple[str, int, int], j: int) -> Transfer:
    kind, mb, src = key
    return Transfer("act" if kind == "fwd" else "grad", mb, src, j)


def _deadlock(schedule: Schedule, nxt: list[int], done: dict, recomputed: set) -> str:
    S, V = schedule.stages, schedule.virtual
    stuck = []
    for s, acts in enumerate(schedule.actions):
        if nxt[s] < len(acts):
            a = acts[nxt[s]]
            j = vstage(s, a, S)
            missing = [f"{k[0]} of mb {k[1]} on virtual stage {k[2]}"
                       for k, _ in inputs(a.kind, a.mb, j, V, (a.mb, j) in recomputed)
                       if k not in done]
            stuck.append(f"stage {s} at {a.label(schedule.chunks)} waits for "
                         + ", ".join(missing))
    return f"{schedule.name} deadlocks: " + "; ".join(stuck)


def _no_latency(transfer: Transfer) -> Fraction:
    return Fraction(0)


@dataclasses.dataclass(frozen=True)
class TickTable:
    """`ticks[i][s]`: stage s's action at row i (IDLE when it waits); `transfers[i]`: what
    moves after row i; `consumed[x]`: the row whose action first reads transfer x.

    A row is one lane of a tick: tick t is rows t*lanes .. t*lanes + lanes-1, run in order, and
    only the last lane's row has transfers after it. An unfused table has one lane (a row is a
    tick); a fused one (`tick_table(fuse=True)`) as many as the longest run a stage takes in
    one tick (at most the kinds of work its schedule has: `fuse.lanes`).

    A backward may span several consecutive ticks (`backward_ticks`: k per virtual stage): its
    stage's layers are split into k parts, part `parts[t][s]` of the backward runs at tick t
    (part 0 first: the top of the stage, which reads the gradient; part k-1 last, which sends
    it). So a tick holds about one forward's work whatever the action, and lockstep ticks stay
    balanced when a backward costs k forwards."""

    schedule: Schedule
    ticks: tuple[tuple[Action, ...], ...]
    transfers: tuple[tuple[Transfer, ...], ...]
    consumed: dict[Transfer, int]
    parts: tuple[tuple[int, ...], ...] = ()
    backward_ticks: tuple[int, ...] = ()  # per virtual stage; () means 1 everywhere
    lanes: int = 1

    @property
    def n_ticks(self) -> int:
        return len(self.ticks) // self.lanes

    def tick_rows(self) -> list[tuple[tuple[Action, ...], ...]]:
        """Per tick, its lanes' rows."""
        L = self.lanes
        return [self.ticks[t * L:(t + 1) * L] for t in range(self.n_ticks)]

    def span(self, j: int) -> int:
        """Ticks one backward of virtual stage j takes."""
        return self.backward_ticks[j] if self.backward_ticks else 1

    def part(self, t: int, s: int) -> int:
        return self.parts[t][s] if self.parts else 0

    def codes(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """`[T][S]` of (op code, micro-batch, chunk): the table an executor switches on
        (`actions.CODES`; IDLE is 0 with micro-batch -1)."""
        return tuple(tuple((CODES[a.kind], a.mb, a.chunk) for a in row) for row in self.ticks)

    @functools.cached_property
    def sends(self) -> int:
        """The most activations, or gradients, one device sends after one tick: the slots of
        each tick's permutes (two where a fused tick runs two forwards that send)."""
        S = self.schedule.stages
        counts = Counter((t, x.kind, x.devices(S)[0])
                         for t, row in enumerate(self.transfers) for x in row)
        return max(counts.values(), default=1)

    def pairs(self, kind: str) -> set[tuple[int, int]]:
        """The (source, destination) devices that ever carry `kind` ("act" or "grad"): the
        ppermute pairs of that direction."""
        S = self.schedule.stages
        return {x.devices(S) for row in self.transfers for x in row if x.kind == kind}

    def wraps(self) -> bool:
        """Whether any transfer closes a ring (only interleaved schedules do)."""
        return any(x.wraps(self.schedule.stages) for row in self.transfers for x in row)

    def held_peak(self, kind: str) -> tuple[int, ...]:
        """Per device, the most `kind` transfers received and not yet read at once (the slots
        of its receive buffer): sent after tick t_s, held from t_s+1 through the reading tick."""
        S = self.schedule.stages
        delta = [[0] * (len(self.ticks) + 2) for _ in range(S)]
        for t, row in enumerate(self.transfers):
            for x in row:
                if x.kind == kind:
                    dst = x.devices(S)[1]
                    delta[dst][t + 1] += 1
                    delta[dst][self.consumed[x] + 1] -= 1
        peaks = []
        for d in delta:
            held = peak = 0
            for v in d:
                held += v
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def pretty(self) -> str:
        """One row per stage, one column per tick; `F3` is micro-batch 3's forward (`F3.1` its
        chunk 1 when devices hold several), `.` an idle tick, `F3+B1` a fused tick's lanes."""
        sch = self.schedule

        def cell(t, s, a):
            split = a.kind == "B" and self.span(vstage(s, a, sch.stages)) > 1
            return a.label(sch.chunks) + ("abcdefgh"[self.part(t, s)] if split else "")

        L = self.lanes
        cells = [["+".join(cell(t * L + lane, s, rows[lane][s]) for lane in range(L)
                           if rows[lane][s].kind != "IDLE") or "."
                  for s in range(sch.stages)] for t, rows in enumerate(self.tick_rows())]
        width = max([len(str(len(cells) - 1)), *(len(c) for row in cells for c in row)])
        head = f"{sch.name}: S={sch.stages} stages, M={sch.microbatches} micro-batches"
        head += f", v={sch.chunks} chunks per stage" if sch.chunks > 1 else ""
        head += ", fused ticks" if L > 1 else ""
        lines = [head, "tick    " + " ".join(f"{t:>{width}}" for t in range(len(cells)))]
        for s in range(sch.stages):
            lines.append(f"stage {s:<2d}" + " ".join(f"{row[s]:>{width}}" for row in cells))
        return "\n".join(lines)


_TABLES: dict[tuple, tuple[Schedule, TickTable]] = {}


def tick_table(schedule: Schedule, backward_ticks: int | Sequence[int] = 1,
               fuse: bool = False, head: bool = False) -> TickTable:
    """Place every action on whole ticks: an action runs at the first tick after everything it
    waits for, and transfers happen between ticks. Unfused, every action takes one tick except a
    backward of virtual stage j, which takes `backward_ticks[j]` (one number: every stage) run
    back to back on its device. Fused (`_fused`), a tick holds a run of each stage's actions.
    `head`: a split head (`executor.HeadProgram`) runs after the tick of each last-stage
    forward, so the last virtual stage's backward of that micro-batch waits for a later tick,
    as for an input from another device (unfused tables always place it so).
    Raises InvalidSchedule on a deadlock. Cached per schedule object, as `_order` is: the
    planner asks the same schedule's tables for its choice, its memory and its step."""
    spans = backward_ticks if isinstance(backward_ticks, int) else tuple(backward_ticks)
    key = (id(schedule), spans, fuse, head and fuse)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]
    table = _tick_table(schedule, backward_ticks, fuse, head)
    if len(_TABLES) > 256:
        _TABLES.clear()
    _TABLES[key] = (schedule, table)
    return table


def _tick_table(schedule: Schedule, backward_ticks: int | Sequence[int], fuse: bool,
                head: bool = False) -> TickTable:
    S, V = schedule.stages, schedule.virtual
    spans = ((backward_ticks,) * V if isinstance(backward_ticks, int)
             else tuple(backward_ticks))
    if len(spans) != V or any(not isinstance(k, int) or k < 1 for k in spans):
        raise InvalidSchedule(f"backward_ticks={backward_ticks!r} must be a positive integer or "
                              f"one per virtual stage ({V})")
    split = any(k > 1 for k in spans)
    if fuse:
        if split:
            raise InvalidSchedule(f"backward_ticks={backward_ticks!r}: a fused tick table runs "
                                  f"each backward in one tick; use 1 or unfused ticks")
        return _fused(schedule, head)

    def duration(stage: int, action: Action) -> Fraction:
        return Fraction(spans[vstage(stage, action, S)] if action.kind == "B" else 1)

    placed = place(schedule, duration, _no_latency)
    T = int(max((f for _, f in placed.values()), default=0))
    grid = [[IDLE] * S for _ in range(T)]
    parts = [[0] * S for _ in range(T)]
    sends: list[list[Transfer]] = [[] for _ in range(T)]
    consumed: dict[Transfer, int] = {}
    for (s, i), (start, finish) in placed.items():
        a = schedule.actions[s][i]
        for p, t in enumerate(range(int(start), int(finish))):
            grid[t][s] = a
            parts[t][s] = p
        sends[int(finish) - 1].extend(a.sends)
        for x in a.recvs:
            consumed[x] = int(start)
    return TickTable(schedule, tuple(map(tuple, grid)), tuple(map(tuple, sends)), consumed,
                     tuple(map(tuple, parts)) if split else (), spans if split else ())


def _fused(schedule: Schedule, head: bool = False) -> TickTable:
    """The fused tick table: each tick, each stage runs the run of its next actions that
    `fuse.cuts` places there (the shortest lockstep step under unit costs), lane k of a tick
    holding the k-th action of every stage's run. `head`: see `tick_table`."""
    S, last = schedule.stages, schedule.virtual - 1

    def after_the_head(s, a, p):
        """Whether producer p is the last stage's forward that a split head runs after."""
        return (head and a.kind == "B" and vstage(s, a, S) == last
                and schedule.actions[p[0]][p[1]].kind in ("F", "PF"))

    order = [(s, i, tuple(p for p, link in deps if link is not None or after_the_head(s, a, p)))
             for s, i, a, deps in _order(schedule)]  # refuses lists that deadlock
    # Two activations (or gradients) a tick widen every tick's permutes: taken where that
    # saves more than `fuse.PER_SEND` a tick.
    best = None
    for k in (1, 2):
        bounds, cost = fuse.cuts(schedule.actions, schedule.chunks, order, k)
        cost += fuse.PER_SEND * (k - 1) * (len(bounds) - 1)
        if best is None or cost < best[0]:
            best = cost, bounds
    steps = list(itertools.pairwise(best[1]))
    L = max(b[s] - a[s] for a, b in steps for s in range(S))
    grid: list[list[Action]] = []
    for a, b in steps:
        rows = [[IDLE] * S for _ in range(L)]
        for s in range(S):
            for lane, i in enumerate(range(a[s], b[s])):
                rows[lane][s] = schedule.actions[s][i]
        grid.extend(rows)
    sends: list[list[Transfer]] = [[] for _ in grid]
    consumed: dict[Transfer, int] = {}
    for i, row in enumerate(grid):
        for a in row:
            sends[(i // L) * L + L - 1].extend(a.sends)
            for x in a.recvs:
                consumed[x] = i
    return TickTable(schedule, tuple(map(tuple, grid)), tuple(map(tuple, sends)), consumed,
                     lanes=L)
