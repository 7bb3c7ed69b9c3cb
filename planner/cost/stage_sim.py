"""A pipeline schedule simulated under per-stage costs, in floats, for the stage partitioner and
the 3D search: the schedule built once per (name, S, M, chunks, recompute flags), the inputs
each stage holds at once, and the makespan with each stage's finish.

`simulate` prices the program the executor runs: its tick table (the schedule on whole ticks,
a backward spread over the runtime's k ticks) in lockstep, every tick as long as its slowest
stage's action (`pipeline.events.lockstep_makespan`, in floats, without its transfers) plus the
permutes the executor issues every tick whether anything moves or not (`permutes_per_tick`).
The compiled program is SPMD: a stage cannot run ahead of the tick, so the event simulator's
run-ahead makespan (`simulate_events`) is only a lower bound of it."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from oases_jax.pipeline import events
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.table import Schedule, place
from oases_jax.pipeline.validate import inflight
from oases_jax.planner.cost.prices import SharedCores

Ends = tuple[float, float, float, float]
NO_ENDS: Ends = (0.0, 0.0, 0.0, 0.0)  # (first_f, first_b, last_f, last_b): see `chunk_costs`


def build(name: str, stages: int, microbatches: int, chunks: int = 1,
          recompute: tuple[bool, ...] | None = None) -> Schedule:
    """The schedule (cached); `recompute`: per-stage flags (Merak's schedule has its own, so
    its flags are not part of the key: a search prices many partitions that differ only in
    them)."""
    return _build(name, stages, microbatches, chunks, _flags_key(name, recompute))


def _flags_key(name: str, recompute: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
    """The recompute flags as a cache key: none for Merak's schedule, which has its own."""
    return None if pipelines.get(name).recompute == "own" else recompute


@functools.lru_cache(maxsize=512)
def _build(name: str, stages: int, microbatches: int, chunks: int,
           recompute: tuple[bool, ...] | None) -> Schedule:
    spec = pipelines.get(name)
    flags = {} if spec.recompute == "own" else {
        "recompute": recompute if recompute is not None else False}
    return spec.build(stages, microbatches, chunks=chunks, **flags)


@functools.lru_cache(maxsize=512)
def fused(name: str, stages: int, microbatches: int, chunks: int = 1,
          split_head: bool = False) -> bool:
    """Whether the runtime runs the schedule on its fused tick table when the plan does not
    say (`PipelineSpec.fused`'s rule: `events.fused_by_default`, never with a split head):
    what the planner prices, so that a plan's memory and step are those of the table it
    runs."""
    return not split_head and events.fused_by_default(build(name, stages, microbatches, chunks))


@functools.lru_cache(maxsize=512)
def peak_inflight(name: str, stages: int, microbatches: int, chunks: int = 1,
                  split_head: bool = False) -> tuple[int, ...]:
    """Most (micro-batch, chunk) inputs each stage holds at once under the schedule, along the
    tick table the runtime runs (a fused table keeps each stage's list order, so it holds what
    the lists do; counted along the table all the same); under
    gpipe_spmd every stage saves the residuals of all M+S-1 ticks (its bubble ticks' too: the
    scan's autodiff keeps every iteration's); under 1f1b_spmd one (the stage inputs it keeps
    are not residuals)."""
    executor = pipelines.get(name).executor
    if executor == "spmd_gpipe":
        return (microbatches + stages - 1,) * stages
    if executor == "spmd_1f1b":  # one micro-batch's residuals, in its backward's recompute
        return (1,) * stages
    sch = build(name, stages, microbatches, chunks)
    fuse = fused(name, stages, microbatches, chunks, split_head)
    return inflight(sch, sch.ticks(fuse=fuse, head=split_head))[0]


def table_choices(name: str, microbatches: int, chunks: int, f: Sequence[float],
                  b: Sequence[float], r: Sequence[float], split_head: bool = False
                  ) -> tuple[tuple[int, bool], ...]:
    """(k, fused) tick tables a plan may run: each backward span of `tick_choices`, the one-tick
    backward on the table `fused` chooses (`pipeline.fuse`: fused, a stage may run a short run
    of its actions in one tick). Not chosen by these costs: the stages' memory
    (`peak_inflight`) depends on the table, and the partitioner fixes it before it prices."""
    fuse = fused(name, len(f), microbatches, chunks, split_head)
    return tuple((k, fuse and k == 1) for k in tick_choices(name, f, b, r))


def tick_choices(name: str, f: Sequence[float], b: Sequence[float],
                 r: Sequence[float]) -> tuple[int, ...]:
    """The ticks a backward may span in the plan (`--backward-ticks`, recorded in the plan):
    one, whatever the schedule (the runtime's default too). Spreading a backward over
    round(B/F) ticks balances the lockstep ticks under this model's costs (B near 2F), but every
    compiled program measured so far runs slower split (docs/planner.md, "Against compiled
    programs"): GPT-2 1.5B on h100:16, stage=2,data=8, interleaved M=2 takes 551.7 ms with two
    ticks against 237.6 ms with one, 1F1B at data=2,stage=2,tensor=4 287.9 against 244.8 ms,
    and interleaved there (M=8) 275.7 against 201.7 ms. `simulate(k=...)` prices other spans
    for study."""
    return (1,)


def table_choice(name: str, microbatches: int, chunks: int, f: Sequence[float],
                 b: Sequence[float], r: Sequence[float], p2p: float = 0.0,
                 ends: Ends = NO_ENDS, head: float = 0.0) -> tuple[int, bool]:
    """The (k, fused) of `table_choices` with the shortest lockstep step (the fewest ticks,
    then unfused, on a tie): what `simulate` priced and the plan records."""
    return min(table_choices(name, microbatches, chunks, f, b, r, head > 0),
               key=lambda kf: (simulate(name, microbatches, chunks, f, b, r, p2p, k=kf[0],
                                        fuse=kf[1], ends=ends, head=head)[0], kf))


def backward_ticks(name: str, microbatches: int, chunks: int, f: Sequence[float],
                   b: Sequence[float], r: Sequence[float], p2p: float = 0.0,
                   ends: Ends = NO_ENDS) -> int:
    """The backward span of `table_choice`."""
    return table_choice(name, microbatches, chunks, f, b, r, p2p, ends)[0]


@functools.lru_cache(maxsize=512)
def whole_stages(name: str, stages: int, microbatches: int, chunks: int = 1
                 ) -> tuple[bool, ...]:
    """Per physical stage, whether the schedule the runtime builds recomputes it whole
    (`Schedule.whole` on each of its chunks): every stage but the last under Merak's."""
    w = build(name, stages, microbatches, chunks).whole()
    return tuple(all(w[c * stages + s] for c in range(len(w) // stages))
                 for s in range(stages))


def _program_costs(f, b, r, whole: Sequence[bool]) -> tuple[tuple, tuple, tuple[bool, ...]]:
    """(F, B, recompute flags) as the executor runs the schedule: a stage it recomputes whole
    (`whole_stages`) has R actions of its own (r its whole forward); the others recompute their
    rematted layers inside their backward (`training.pipeline_step`), so their B is b + r."""
    return (tuple(f), tuple(bb + (0.0 if w else rr) for bb, rr, w in zip(b, r, whole,
                                                                        strict=True)),
            tuple(whole))


def chunk_costs(x: Sequence[float], chunks: int, first: float = 0.0, last: float = 0.0
                ) -> tuple[tuple[float, ...], ...]:
    """Per stage, per chunk: the share of a stage's cost `x` one of its `chunks` equal chunks
    runs, with the embedding's part `first` of stage 0's cost on its chunk 0 alone and the head
    and loss's part `last` of the last stage's cost on its last chunk alone (virtual stages 0
    and vS-1: the executor runs them there, not spread over the device's chunks)."""
    S, v = len(x), chunks
    out = []
    for s, total in enumerate(x):
        own = [0.0] * v
        if s == 0:
            own[0] += first
        if s == S - 1:
            own[-1] += last
        rest = total - (first if s == 0 else 0.0) - (last if s == S - 1 else 0.0)
        out.append(tuple(rest / v + o for o in own))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _ticks(name: str, stages: int, microbatches: int, chunks: int,
           recompute: tuple[bool, ...] | None, k: int, fuse: bool = False, head: bool = False
           ) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per tick: the (stage, kind, chunk) of every non-idle cell of its lanes."""
    table = build(name, stages, microbatches, chunks, recompute).ticks(k, fuse, head)
    return tuple(tuple((s, a.kind, a.chunk) for row in rows for s, a in enumerate(row)
                       if a.kind != "IDLE") for rows in table.tick_rows())


def permutes_per_tick(chunks: int, sends: int = 1) -> int:
    """Stage-to-stage transfers the executor issues each tick, each priced as one
    activation: one activation and one gradient permute, and with several chunks per device
    the S-1 -> 0 edge's activation and gradient as permutes of their own (GPT-2 1.5B on
    h100:16: 0.15 ms of permutes a tick for GPipe, 0.28 ms for interleaved, at 0.074 ms per
    activation); each carries `sends` activations where a fused table sends two a tick
    (`TickTable.sends`)."""
    return (2 if chunks == 1 else 4) * sends


def simulate(name: str, microbatches: int, chunks: int, f: Sequence[float],
             b: Sequence[float], r: Sequence[float], p2p: float = 0.0,
             k: int | None = None, ends: Ends = NO_ENDS, shared: SharedCores | None = None,
             fuse: bool | None = None, head: float = 0.0) -> tuple[float, tuple[float, ...]]:
    """(step, per-stage finish) of the schedule's tick table in lockstep with these per-stage
    costs (module docstring), each backward over `k` ticks (default: the best of
    `table_choices`), the table fused or not (`fuse`; default: `fused`'s choice for a one-tick
    backward, else unfused): what the compiled program's tick loop
    takes; a fused tick lasts as long as its slowest stage's lanes together. `ends`: the
    embedding's forward and backward inside stage 0's f and b and the head's inside the last
    stage's, which run on one chunk each (`chunk_costs`). `shared`: the devices share a host's cores
    (CPU devices), so a tick lasts as long as its stages' work takes on the cores they share
    (`SharedCores.tick`) rather than its slowest stage's. `head`: a split head's phase, one
    a micro-batch on every device between ticks (`--split-head on`: the ends' last_f and
    last_b are then 0, the table unfused unless `fuse` says, and on a fused one the last
    stage's backward waits a tick for its forward's head); every stage's last action follows
    the last phase."""
    if k is None:
        return min((simulate(name, microbatches, chunks, f, b, r, p2p, k=kk, ends=ends,
                             shared=shared, fuse=ff if fuse is None else fuse and kk == 1,
                             head=head)
                    for kk, ff in table_choices(name, microbatches, chunks, f, b, r, head > 0)),
                   key=lambda got: got[0])
    if fuse is None:
        fuse = k == 1 and fused(name, len(f), microbatches, chunks, head > 0)
    S = len(f)
    f, b_run, recompute = _program_costs(f, b, r, whole_stages(name, S, microbatches, chunks))
    v = build(name, S, microbatches, chunks, recompute).chunks
    first_f, first_b, last_f, last_b = ends
    fc = chunk_costs(f, v, first_f, last_f)
    bc = chunk_costs(tuple(x / k for x in b_run), v, first_b / k, last_b / k)
    rc = chunk_costs(r, v)
    cost = {"F": fc, "PF": fc, "R": rc, "RrG": rc, "B": bc, "W": ((0.0,) * v,) * S}
    total, finish = 0.0, [0.0] * S
    sends = build(name, S, microbatches, chunks, recompute).ticks(k, fuse, head > 0).sends
    per_tick = p2p * permutes_per_tick(v, sends) if S > 1 else 0.0
    for cells in _ticks(name, S, microbatches, chunks, _flags_key(name, recompute), k, fuse,
                        head > 0):
        work = [0.0] * S  # per stage, its lanes together (idle stages 0: neither max nor
        for s, kind, c in cells:  # SharedCores.tick counts them)
            work[s] += cost[kind][s][c]
        total += shared.tick(work, S) if shared else max(work)
        for s, _, _ in cells:
            finish[s] = total
        total += per_tick
    heads = microbatches * head
    return total + heads, tuple(x + heads for x in finish)


def simulate_events(name: str, microbatches: int, chunks: int, f: Sequence[float],
                    b: Sequence[float], r: Sequence[float], p2p: float = 0.0,
                    ends: Ends = NO_ENDS) -> tuple[float, tuple[float, ...]]:
    """(makespan, per-stage finish) of the schedule with these per-stage costs when every stage
    runs ahead on its own (a lower bound of `simulate`): the event simulator's list scheduler
    (`oases_jax.pipeline.table.place`) in floats, for speed; `oases_jax.pipeline.events.
    simulate` gives the same in exact fractions."""
    S = len(f)
    flags = tuple(x > 0 for x in r)
    whole = whole_stages(name, S, microbatches, chunks)
    if any(whole):  # a stage not recomputed whole recomputes inside its backward
        _, b, flags = _program_costs(f, b, r, whole)
    sch = build(name, S, microbatches, chunks, flags)
    v = sch.chunks
    first_f, first_b, last_f, last_b = ends
    fc, bc, rc = chunk_costs(f, v, first_f, last_f), chunk_costs(b, v, first_b, last_b), \
        chunk_costs(r, v)
    dur = {"F": fc, "PF": fc, "R": rc, "RrG": rc, "B": bc, "W": ((0.0,) * v,) * S}
    placed = place(sch, lambda s, a: dur[a.kind][s][a.chunk], lambda t: p2p)
    finish = [0.0] * S
    for (s, _), (_, end) in placed.items():
        finish[s] = max(finish[s], float(end))
    return max(finish), tuple(finish)
