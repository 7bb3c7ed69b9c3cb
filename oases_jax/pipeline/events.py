"""Event simulator of a pipeline schedule: when each action starts and finishes given per-stage
costs, and what that makes of the step (makespan, busy and idle time, bubble, recompute).

Each stage runs its actions in order, each as soon as the stage is free and its inputs are done
(a transfer adds `p2p`); links carry any number of transfers at once. All arithmetic is exact
(`fractions.Fraction`), so formulas such as GPipe's bubble (S-1)/(M+S-1) compare exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from fractions import Fraction

from oases_jax.errors import UserError
from oases_jax.pipeline.actions import RECOMPUTES, Action, Transfer, vstage
from oases_jax.pipeline.table import Schedule, TickTable, place
from oases_jax.pipeline.validate import inflight

Number = int | float | Fraction
PerStage = Number | Sequence[Number]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Time of one micro-batch's work on a whole stage (all its chunks; an interleaved chunk
    takes 1/v of it). `b` is the whole backward; in a split (zero-bubble) schedule B takes
    b - w and W takes w. `r` is a recompute (R or RrG), by default a forward: with Merak's
    stage-aware ratios give r_i * f_i. `p2p`: time of one stage-to-stage transfer. Each cost is
    one number for every stage or one per stage."""

    f: PerStage = 1
    b: PerStage = 2
    w: PerStage = 0
    r: PerStage | None = None
    p2p: Number = 0

    def per_stage(self, stages: int) -> dict[str, tuple[Fraction, ...]]:
        """Each cost as S exact numbers, checked: non-negative, one per stage, w <= b."""
        out = {}
        for name in ("f", "b", "w", "r"):
            value = getattr(self, name)
            value = self.f if value is None else value
            values = [value] * stages if isinstance(value, Number) else list(value)
            if len(values) != stages:
                raise UserError(f"cost {name} has {len(values)} values for S={stages} stages: "
                                f"give one per stage, or one number for all")
            if any(not isinstance(x, Number) or x < 0 for x in values):
                raise UserError(f"cost {name}={value!r} must be non-negative numbers")
            out[name] = tuple(Fraction(x) for x in values)
        if any(w > b for w, b in zip(out["w"], out["b"], strict=True)):
            raise UserError(f"weight-gradient cost w={self.w!r} exceeds the backward b={self.b!r}:"
                            f" w is the part of b that computes weight gradients")
        if not isinstance(self.p2p, Number) or self.p2p < 0:
            raise UserError(f"transfer time p2p={self.p2p!r} must be a non-negative number")
        return out


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The simulated step. `spans[s]`: (action, start, finish) of stage s in order."""

    schedule: Schedule
    spans: tuple[tuple[tuple[Action, Fraction, Fraction], ...], ...]
    makespan: Fraction
    busy: tuple[Fraction, ...]  # per stage: time running any action
    recompute: tuple[Fraction, ...]  # per stage: time in R and RrG (part of busy)
    peak_inflight: tuple[int, ...]  # per stage: most (mb, chunk) inputs held at once

    @property
    def idle(self) -> tuple[Fraction, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> Fraction:
        """Idle share of all stages' time: sum(idle) / (S * makespan)."""
        S = self.schedule.stages
        return sum(self.idle, Fraction(0)) / (S * self.makespan) if self.makespan else Fraction(0)

    @property
    def recompute_share(self) -> Fraction:
        """Recompute share of all stages' time (busy, but redoing forwards)."""
        S = self.schedule.stages
        total = sum(self.recompute, Fraction(0))
        return total / (S * self.makespan) if self.makespan else Fraction(0)

    def start(self, stage: int, label: str) -> Fraction:
        """Start of the action labelled `label` (e.g. `B3`, `F2.1`) on `stage`."""
        chunks = self.schedule.chunks
        return next(t for a, t, _ in self.spans[stage] if a.label(chunks) == label)


def durations(schedule: Schedule, costs: Costs) -> dict[str, tuple[Fraction, ...]]:
    """Per kind, per stage: the time of one action (one chunk of one micro-batch)."""
    c = costs.per_stage(schedule.stages)
    v = schedule.chunks
    b = tuple(bb - ww for bb, ww in zip(c["b"], c["w"], strict=True)) if (
        schedule.split_backward) else c["b"]
    per = {"F": c["f"], "PF": c["f"], "R": c["r"], "RrG": c["r"], "B": b, "W": c["w"]}
    return {kind: tuple(x / v for x in xs) for kind, xs in per.items()}


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Run `schedule` under `costs` (default F=1, B=2, R=F, no transfer time)."""
    costs = costs or Costs()
    dur = durations(schedule, costs)
    p2p = Fraction(costs.p2p)

    def duration(stage: int, action: Action) -> Fraction:
        return dur[action.kind][stage]

    def latency(transfer: Transfer) -> Fraction:
        return p2p

    placed = place(schedule, duration, latency)
    spans = tuple(tuple((a, *placed[(s, i)]) for i, a in enumerate(acts))
                  for s, acts in enumerate(schedule.actions))
    makespan = max((f for _, f in placed.values()), default=Fraction(0))
    busy = tuple(sum((f - t for _, t, f in row), Fraction(0)) for row in spans)
    rec = tuple(sum((f - t for a, t, f in row if a.kind in RECOMPUTES), Fraction(0))
                for row in spans)
    return Timeline(schedule, spans, makespan, busy, rec, inflight(schedule)[0])


def lockstep_makespan(table: TickTable, costs: Costs | None = None) -> Fraction:
    """The step of an SPMD program that runs `table` tick by tick: every tick lasts as long as
    its slowest stage's work (the sum of its lanes in a fused table; a backward spread over k
    ticks counts b/k in each; plus `p2p` when anything moves after it). Compare with
    `simulate`'s makespan, where each stage runs ahead on its own."""
    costs = costs or Costs()
    dur = durations(table.schedule, costs)
    S, L = table.schedule.stages, table.lanes

    def cell(s: int, a: Action) -> Fraction:
        # A backward spread over k ticks: each tick runs one k-th of it.
        return dur[a.kind][s] / (table.span(vstage(s, a, S)) if a.kind == "B" else 1)

    total = Fraction(0)
    for t, rows in enumerate(table.tick_rows()):
        total += max((sum((cell(s, row[s]) for row in rows if row[s].kind != "IDLE"),
                          Fraction(0)) for s in range(S)), default=Fraction(0))
        total += Fraction(costs.p2p) if table.transfers[t * L + L - 1] else 0
    return total


def fused_by_default(schedule: Schedule, costs: Costs | None = None) -> bool:
    """Whether the executor runs `schedule` on its fused tick table when nothing chooses: when
    that table's lockstep step is shorter than the unfused one's under `costs` (default F=1,
    B=2, R=1). So with B = 2F, at M=8: 1F1B at S=2 (27 against 34 units) and S=4 (39 against
    40), interleaved at S=2 and 4, Merak's at S=2 (32 against 33) and S=4 (44 against 51); not
    GPipe's (the tables tie), nor from S=8 (`fuse.EXACT_STAGES`), where the greedy placement
    is slower (1F1B at S=8, M=32: 186 against 148)."""
    return (lockstep_makespan(schedule.ticks(fuse=True), costs)
            < lockstep_makespan(schedule.ticks(), costs))
