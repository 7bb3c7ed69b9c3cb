"""Balanced pipeline stages: contiguous, possibly uneven layer ranges and per-stage recompute
counts that minimise the step of a pipeline schedule under the event simulator, within each
stage's memory (docs/planner.md, "Stage partitioner").

An exact dynamic program over boundaries gives the least bottleneck (max over stages of one
micro-batch's forward + backward + recompute); a branch and bound over partitions then runs
the simulator on those whose lower bound can still beat the best found, and falls back to a
local search around the bottleneck optimum when that set is too large to enumerate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from oases_jax.errors import UserError
from oases_jax.planner.cost.prices import SharedCores
from oases_jax.planner.cost.stage_sim import (
    NO_ENDS,
    Ends,
    build,
    peak_inflight,
    simulate,
    table_choice,
    whole_stages,
)

__all__ = ["StageInputs", "StagePlan", "bottleneck", "build", "fixed", "partition",
           "peak_inflight", "simulate"]

# --- What the partitioner works on and returns --------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageInputs:
    """Per layer, one micro-batch, one device: forward `f`, backward `b` (no recompute), the
    recompute `r` a rematted layer adds, the activations kept per micro-batch in flight without
    (`act`) and with (`act_remat`) remat, and the backward's working set (`temp`,
    `temp_remat`). `block_bytes`: one layer's parameters, gradients and optimizer state (the
    stage layout pads every stage to the longest one's layer count). The embedding runs on the
    first stage (`first_f`, `first_b`), the head and loss on the last (`last_f`, `last_b`,
    `last_temp`); `shared_bytes` (embedding and head state) sits on every stage."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    r: tuple[float, ...]
    act: tuple[float, ...]
    act_remat: tuple[float, ...]
    temp: tuple[float, ...]
    temp_remat: tuple[float, ...]
    # What a layer's forward spends storing its residuals for the backward (inside `f`), and
    # what it saves of that when rematted (it stores only its input). Zero where nothing is
    # stored between ticks.
    store: tuple[float, ...] = ()
    store_save: tuple[float, ...] = ()
    block_bytes: float = 0.0
    shared_bytes: float = 0.0
    first_f: float = 0.0
    first_b: float = 0.0
    last_f: float = 0.0
    last_b: float = 0.0
    last_temp: float = 0.0
    # A split head (`--split-head on`): its phase on every device, once a micro-batch (the
    # ends' last_f and last_b are then 0); 0: the head is the last stage's.
    head_phase: float = 0.0
    # Devices that share a host's cores (CPU devices: `Hardware.shared_cores`), which the
    # simulator's ticks then price by processor sharing; None on GPUs.
    shared: SharedCores | None = None

    def __post_init__(self):
        n = len(self.f)
        for name in ("store", "store_save"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0.0,) * n)

    @classmethod
    def uniform(cls, n_layers: int, *, f: float, b: float, r: float = 0.0, act: float = 0.0,
                act_remat: float = 0.0, temp: float = 0.0, temp_remat: float = 0.0,
                store: float = 0.0, store_save: float = 0.0, **ends: float) -> StageInputs:
        """`n_layers` identical layers."""
        n = n_layers
        return cls(f=(f,) * n, b=(b,) * n, r=(r,) * n, act=(act,) * n,
                   act_remat=(act_remat,) * n, temp=(temp,) * n, temp_remat=(temp_remat,) * n,
                   store=(store,) * n, store_save=(store_save,) * n, **ends)

    @property
    def n_layers(self) -> int:
        return len(self.f)

    @property
    def ends(self) -> Ends:
        """(first_f, first_b, last_f, last_b): what the embedding and the head add to the end
        stages, on one chunk each (`stage_sim.chunk_costs`)."""
        return (self.first_f, self.first_b, self.last_f, self.last_b)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A partition: layers and recomputed layers (its first ones) per stage, each stage's time
    of one micro-batch (f, b, r) and memory, and the simulated step. `exact`: the branch and
    bound proved the step the least over all partitions (else a local optimum)."""

    schedule: str
    microbatches: int
    chunks: int
    layers: tuple[int, ...]
    remat: tuple[int, ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    r: tuple[float, ...]
    memory: tuple[float, ...]
    makespan: float
    finish: tuple[float, ...]  # per stage: when its last action ends
    exact: bool
    p2p: float = 0.0  # the stage-to-stage transfer time the step was simulated with
    ends: Ends = NO_ENDS  # the embedding's and head's f, b inside the end stages' (`simulate`)
    head_phase: float = 0.0  # a split head's phase a micro-batch on every stage (`StageInputs`)

    @property
    def split_head(self) -> bool:
        return self.head_phase > 0

    @property
    def stages(self) -> int:
        return len(self.layers)

    @property
    def loads(self) -> tuple[float, ...]:
        return tuple(f + b + r + self.head_phase
                     for f, b, r in zip(self.f, self.b, self.r, strict=True))

    @property
    def balance(self) -> float:
        """max stage load / mean stage load (1 is perfect balance)."""
        loads = self.loads
        return max(loads) / (sum(loads) / len(loads))

    @property
    def tick_table(self) -> tuple[int, bool]:
        """(ticks each backward spans, fused table) of the program this plan runs: the choice
        its step was simulated with (`stage_sim.table_choice`); the plan records both."""
        return table_choice(self.schedule, self.microbatches, self.chunks, self.f, self.b,
                            self.r, self.p2p, self.ends, self.head_phase)

    @property
    def backward_ticks(self) -> int:
        return self.tick_table[0]

    @property
    def fused_ticks(self) -> bool:
        return self.tick_table[1]

    @property
    def ratios(self) -> tuple[Fraction, ...]:
        """Per-stage recompute ratios k_i / n_i, exact (floor(n_i r_i) = k_i at run time)."""
        return tuple(Fraction(k, n) for k, n in zip(self.remat, self.layers, strict=True))


# --- The partitioner -------------------------------------------------------------------------

MAX_LEAVES = 4000  # partitions the branch and bound may enumerate before it gives up exactness
MAX_SIMS = 48  # simulator runs per partition search


class _Stages:
    """Stage loads and memory of contiguous layer ranges, by prefix sums."""

    def __init__(self, x: StageInputs, name: str, stages: int, microbatches: int, chunks: int,
                 budget: float):
        self.x, self.S, self.M, self.v, self.budget = x, stages, microbatches, chunks, budget
        self.name = name
        self.held = peak_inflight(name, stages, microbatches, chunks, x.head_phase > 0)
        self.whole = whole_stages(name, stages, microbatches, chunks)
        cum = lambda a: np.concatenate([[0.0], np.cumsum(np.asarray(a, float))])  # noqa: E731
        self.F, self.B, self.R = cum(x.f), cum(x.b), cum(x.r)
        self.STORE, self.STORE_SAVE = cum(x.store), cum(x.store_save)
        self.A, self.SAVE = cum(x.act), cum(np.subtract(x.act, x.act_remat))
        # Python lists: max() over a short slice is a few times faster than np.max, and the
        # partition DPs call it hundreds of thousands of times.
        self.temp = [float(t) for t in x.temp]
        self.temp_remat = [float(t) for t in x.temp_remat]

    def stage(self, s: int, i: int, j: int, lmax: int, remat: int | None = None
              ) -> tuple[float, float, float, int, float] | None:
        """(f, b, r, recomputed layers, memory) of stage s on layers [i, j) when the longest
        stage holds `lmax` layers: with `remat` recomputed layers (its first ones), else the
        fewest that fit the budget; None when that does not fit."""
        x, last = self.x, s == self.S - 1
        f = self.F[j] - self.F[i] + (x.first_f if s == 0 else 0) + (x.last_f if last else 0)
        b = self.B[j] - self.B[i] + (x.first_b if s == 0 else 0) + (x.last_b if last else 0)
        static = x.shared_bytes + lmax * x.block_bytes
        per_mb = self.held[s] / self.v
        head = x.last_temp if last or x.head_phase else 0.0  # split: every stage's part
        if self.whole[s]:
            return self._whole(i, j, f, b, static, per_mb)
        counts = (remat,) if remat is not None else self._remat_counts(i, j, per_mb,
                                                                       self.budget - static)
        for k in counts:
            temp = max(head, max(self.temp_remat[i:i + k], default=0.0),
                       max(self.temp[i + k:j], default=0.0))
            mem = static + per_mb * (self.A[j] - self.A[i] - (self.SAVE[i + k] - self.SAVE[i])) \
                + temp
            if mem <= self.budget * (1 + 1e-12):
                # A rematted layer's forward stores only its input.
                saved = float(self.STORE_SAVE[i + k] - self.STORE_SAVE[i])
                return f - saved, b, float(self.R[i + k] - self.R[i]), k, mem
        return None

    def _whole(self, i: int, j: int, f: float, b: float, static: float, per_mb: float
               ) -> tuple[float, float, float, int, float] | None:
        """A stage the schedule recomputes whole (`stage_sim.whole_stages`): each held
        micro-batch keeps only its input, its R re-runs the whole forward (`f`, the embedding's
        on stage 0 too) and keeps every residual of one micro-batch until its B; all its
        layers count as recomputed (ratio 1), whatever the budget asks."""
        x = self.x
        temp = max(self.temp[i:j], default=0.0)
        mem = static + per_mb * float(x.act_remat[i]) + float(self.A[j] - self.A[i]) + temp
        if mem > self.budget * (1 + 1e-12):
            return None
        # F stashes the input and stores no residual; R runs the forward and stores them all.
        return f - float(self.STORE[j] - self.STORE[i]), b, f, j - i, mem

    def _remat_counts(self, i: int, j: int, per_mb: float, room: float):
        """0, then from the least k >= 1 whose activation saving reaches the excess over the
        room left by the static bytes (the working set only adds to it) upward."""
        yield 0
        need = self.A[j] - self.A[i] - room / per_mb if per_mb else -1.0
        lo = int(np.searchsorted(self.SAVE[i + 1:j + 1] - self.SAVE[i], need - 1e-9,
                                 side="left")) + 1
        yield from range(lo, j - i + 1)

    def evaluate(self, counts: Sequence[int]) -> list | None:
        """Per stage (f, b, r, k, memory) of a partition, or None when a stage does not fit."""
        lmax, out, i = max(counts), [], 0
        for s, n in enumerate(counts):
            st = self.stage(s, i, i + n, lmax)
            if st is None:
                return None
            out.append(st)
            i += n
        return out


def bottleneck(st: _Stages, lmax: int) -> tuple[float, tuple[int, ...]] | None:
    """Exact DP: min over partitions with at most `lmax` layers a stage of the max stage load
    (f + b + r, each stage's least recompute that fits), and one partition attaining it.
        best[s][j] = min_i max(best[s-1][i], load(s-1; layers i..j-1))"""
    L, S = st.x.n_layers, st.S
    inf = math.inf
    best = [[inf] * (L + 1) for _ in range(S + 1)]
    arg = [[-1] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for j in range(s, L - (S - s) + 1):
            for i in range(max(s - 1, j - lmax), j):
                if best[s - 1][i] == inf:
                    continue
                got = st.stage(s - 1, i, j, lmax)
                if got is None:
                    continue
                value = max(best[s - 1][i], got[0] + got[1] + got[2])
                if value < best[s][j]:
                    best[s][j], arg[s][j] = value, i
    if best[S][L] == inf:
        return None
    counts, j = [], L
    for s in range(S, 0, -1):
        i = arg[s][j]
        counts.append(j - i)
        j = i
    return best[S][L], tuple(reversed(counts))


def _lower_bound(stages: list, microbatches: int, chunks: int) -> float:
    """No schedule beats max_s [M load_s + (with one chunk) the forward of micro-batch 0 through
    the earlier stages and the backward of the last one back through them]: a stage must do its
    M micro-batches' work, and (v = 1) cannot start before the first activation reaches it, nor
    the step end before its last gradient reaches stage 0."""
    lb, before = 0.0, 0.0
    for f, b, r, _, _ in stages:
        lb = max(lb, microbatches * (f + b + r) + (before if chunks == 1 else 0.0))
        before += f + b
    return lb


def partition(x: StageInputs, *, schedule: str, stages: int, microbatches: int,
              chunks: int = 1, p2p: float = 0.0, budget: float = math.inf,
              max_leaves: int = MAX_LEAVES, max_sims: int = MAX_SIMS) -> StagePlan | None:
    """The partition of `x`'s layers over `stages` that minimises the simulated step of
    `schedule` with `microbatches` micro-batches (`chunks` per stage: interleaved), within
    `budget` bytes per stage; None when no partition fits."""
    L, S = x.n_layers, stages
    if L < S:
        raise UserError(f"{L} layers cannot fill S={S} pipeline stages: use at most {L} stages")
    step = 1 if schedule != "interleaved" else chunks
    st = _Stages(x, schedule, S, microbatches, chunks, budget)
    sims: dict[tuple[int, ...], tuple[float, tuple[float, ...], list]] = {}

    def run(counts: tuple[int, ...]) -> float:
        if counts not in sims:
            got = st.evaluate(counts)
            if got is None:
                return math.inf
            f, b, r = ([g[k] for g in got] for k in range(3))
            sims[counts] = (*simulate(schedule, microbatches, chunks, f, b, r, p2p,
                                      ends=x.ends, shared=x.shared, head=x.head_phase), got)
        return sims[counts][0]

    if step > 1:  # interleaved: every stage's count a multiple of v (equal chunks)
        if L % step:
            return None
        seeds = _chunked_seeds(st, S, L, step)
    else:
        seeds = _bottleneck_seeds(st, L, S)
    for c in seeds:
        run(c)
    if not sims or min(v[0] for v in sims.values()) == math.inf:
        return None
    exact = step == 1 and _branch_and_bound(st, run, sims, L, S, max_leaves, max_sims)
    if not exact:
        _local_search(run, sims, step, max_sims)
    # Lockstep ticks tie often (a tick lasts its slowest stage's action whatever the others
    # hold): among equal steps the most balanced stages win, then the smallest counts.
    counts = min(sims, key=lambda c: (float(f"{sims[c][0]:.9g}"),
                                      max(g[0] + g[1] + g[2] for g in sims[c][2]), c))
    makespan, finish, got = sims[counts]
    f, b, r, k, mem = (tuple(g[i] for g in got) for i in range(5))
    return StagePlan(schedule, microbatches, chunks, counts, k, f, b, r, mem, makespan, finish,
                     exact, p2p, x.ends, x.head_phase)


def fixed(x: StageInputs, *, schedule: str, counts: Sequence[int], remat: Sequence[int],
          microbatches: int, chunks: int = 1, p2p: float = 0.0, budget: float = math.inf
          ) -> StagePlan | None:
    """A given partition with given recomputed layers per stage (e.g. Megatron's uniform split
    with full recompute), simulated and its memory counted like `partition`'s; None when a
    stage does not fit `budget`."""
    st = _Stages(x, schedule, len(counts), microbatches, chunks, budget)
    lmax, i, got = max(counts), 0, []
    for s, (n, k) in enumerate(zip(counts, remat, strict=True)):
        one = st.stage(s, i, i + n, lmax, remat=k)
        if one is None:
            return None
        got.append(one)
        i += n
    f, b, r, k, mem = (tuple(g[j] for g in got) for j in range(5))
    makespan, finish = simulate(schedule, microbatches, chunks, f, b, r, p2p, ends=x.ends,
                                shared=x.shared, head=x.head_phase)
    return StagePlan(schedule, microbatches, chunks, tuple(counts), k, f, b, r, mem, makespan,
                     finish, False, p2p, x.ends, x.head_phase)


def _bottleneck_seeds(st: _Stages, L: int, S: int) -> list[tuple[int, ...]]:
    """The bottleneck DP's partition for each longest-stage length `lmax` that can still win:
    a stage of lmax layers loads at least lmax x the lightest layer, so the loop stops once
    that reaches the best bottleneck found."""
    lightest = min(f + b for f, b in zip(st.x.f, st.x.b, strict=True))
    found, best = [], math.inf
    for lmax in range(-(-L // S), L - S + 2):
        if lmax * lightest >= best:
            break
        got = bottleneck(st, lmax)
        if got is not None:
            found.append(got)
            best = min(best, got[0])
    return [c for _, c in sorted(found)[:3]]


def _chunked_seeds(st: _Stages, S: int, L: int, v: int) -> list[tuple[int, ...]]:
    """Interleaved stages hold multiples of v layers: the uniform split of L / v groups, and
    one group moved off the last stage (the head's)."""
    groups = L // v
    if groups < S:
        return []
    base, extra = divmod(groups, S)
    uni = [base + (i < extra) for i in range(S)]
    out = [tuple(n * v for n in uni)]
    if uni[-1] > 1:
        moved = list(uni)
        moved[-1] -= 1
        moved[(S - 2) if extra == 0 else extra] += 1
        out.append(tuple(n * v for n in moved))
    return out


def _branch_and_bound(st: _Stages, run, sims: dict, L: int, S: int, max_leaves: int,
                      max_sims: int) -> bool:
    """Simulate, in order of their lower bound, every partition whose bound is below the best
    step found; True when that set was enumerated in full (the best is then the optimum)."""
    best = min(v[0] for v in sims.values())
    leaves: list[tuple[float, tuple[int, ...]]] = []
    M, v = st.M, st.v
    nodes = [0]

    def dfs(prefix: list[int], used: int, before: float, lb: float) -> bool:
        s = len(prefix)
        nodes[0] += 1
        if nodes[0] > 20 * max_leaves:
            return False
        if s == S - 1:
            n = L - used
            counts = (*prefix, n)
            got = st.evaluate(counts)
            if got is not None:
                bound = _lower_bound(got, M, v)
                if bound < best:
                    leaves.append((bound, counts))
            return len(leaves) <= max_leaves
        for n in range(1, L - used - (S - 1 - s) + 1):
            # Optimistic: this stage as if no later stage were longer (less static memory).
            got = st.stage(s, used, used + n, max([n, *prefix]))
            if got is None:
                continue
            load = got[0] + got[1] + got[2]
            bound = max(lb, M * load + before)
            if bound >= best:
                if M * load >= best:  # longer stages only load more
                    break
                continue
            if not dfs([*prefix, n], used + n, before + got[0] + got[1], bound):
                return False
        return True

    if not dfs([], 0, 0.0, 0.0):
        return False
    leaves.sort()
    for bound, counts in leaves:
        if bound >= best:
            return True
        if len(sims) >= max_sims:
            return False
        best = min(best, run(counts))
    return True


def _local_search(run, sims: dict, step: int, max_sims: int) -> None:
    """Move one boundary by `step` layers at a time while the simulated step improves."""
    current = min(sims, key=lambda c: sims[c][0])
    improved = True
    while improved and len(sims) < max_sims:
        improved = False
        S = len(current)
        for i in range(S - 1):
            for d in (step, -step):
                c = list(current)
                c[i] += d
                c[i + 1] -= d
                if min(c) < step:
                    continue
                c = tuple(c)
                if run(c) < sims[current][0]:
                    current, improved = c, True
                if len(sims) >= max_sims:
                    return
