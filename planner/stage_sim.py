"""A pipeline schedule simulated under per-stage costs, in floats, for the stage partitioner and
the 3D search: the schedule built once per (name, S, M, chunks, recompute flags), the inputs
each stage holds at once, and the makespan with each stage's finish."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from oases_jax.pipeline import schedules
from oases_jax.pipeline.table import Schedule, place
from oases_jax.pipeline.validate import inflight


@functools.lru_cache(maxsize=512)
def build(name: str, stages: int, microbatches: int, chunks: int = 1,
          recompute: tuple[bool, ...] | None = None) -> Schedule:
    """The schedule (cached); `recompute`: per-stage flags (Merak's schedule has its own)."""
    flags = recompute if recompute is not None else False
    if name == "merak":
        return schedules.merak(stages, microbatches)
    if name == "interleaved":
        return schedules.interleaved(stages, microbatches, chunks, recompute=flags)
    return schedules.get(name)(stages, microbatches, recompute=flags)


@functools.lru_cache(maxsize=512)
def peak_inflight(name: str, stages: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Most (micro-batch, chunk) inputs each stage holds at once under the schedule."""
    return inflight(build(name, stages, microbatches, chunks))[0]


def simulate(name: str, microbatches: int, chunks: int, f: Sequence[float],
             b: Sequence[float], r: Sequence[float], p2p: float = 0.0
             ) -> tuple[float, tuple[float, ...]]:
    """(makespan, per-stage finish) of the schedule with these per-stage costs: the event
    simulator's list scheduler (`oases_jax.pipeline.table.place`) in floats, for speed;
    `oases_jax.pipeline.events.simulate` gives the same in exact fractions."""
    S = len(f)
    sch = build(name, S, microbatches, chunks, tuple(x > 0 for x in r))
    v = sch.chunks
    dur = {"F": f, "PF": f, "R": r, "RrG": r, "B": b, "W": (0.0,) * S}
    placed = place(sch, lambda s, a: dur[a.kind][s] / v, lambda t: p2p)
    finish = [0.0] * S
    for (s, _), (_, end) in placed.items():
        finish[s] = max(finish[s], float(end))
    return max(finish), tuple(finish)
