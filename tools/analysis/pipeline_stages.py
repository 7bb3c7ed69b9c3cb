"""Per-stage account of a compiled pipelined program: forward, backward and recompute FLOPs of
each stage from its branch computations, and the activation memory each stage's device holds
under the plan (docs/inspection.md, "Per-stage recompute and memory").

FLOPs. The tick loop's conditional has one branch computation per `Plan.branches` entry
(`pipeline_time.find_tick_loop`); `Program.flops_of` counts each one's GEMM FLOPs and the plan's
rows say how often each stage runs it. Per stage and step:

    forward   = sum over its F and FS ticks of the branch's FLOPs
    backward  = sum over its B ticks (every part of a backward spread over several ticks)
    recompute = its R ticks (whole-stage recompute before the backward, R and RrG)
                + backward - 2 x forward          (the remat inside the backward)

A backward without remat does twice its forward's GEMM FLOPs (every GEMM has an input- and a
weight-gradient GEMM of its size; tested against the compiled program), so what the backward
does beyond 2 x forward is the forward it re-runs.

Memory. Every device of one SPMD program allocates the same buffers, so XLA's memory analysis
gives one figure for all stages: the residual pools are sized to what any device needs
(per (shape, dtype) bucket, the largest over devices). What differs between stages is what
their own slots hold:

    held_s = sum over virtual stages j on device s of
             res_slots_j x residual bytes of one micro-batch of j + stash_slots_j x stash bytes

with the slots from the plan and each leaf's per-device bytes from the pool buffer the compiled
tick loop carries for it (so tensor-parallel sharding is counted as compiled). The rest of the
program's peak (parameters, optimizer state, gradient accumulator, receive buffers, transient
work) is common to every device: `common = XLA's peak - pool bytes`, and a stage's peak is
`common + held_s`: what a device running only that stage would need.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from oases_jax.pipeline.executor import BRANCH, Plan
from oases_jax.pipeline.pools import pool_layout
from oases_jax.tools.analysis.hlo import DTYPE_BYTES, parse_shapes
from oases_jax.tools.analysis.pipeline_time import TickLoop, find_tick_loop
from oases_jax.tools.analysis.program import Program

FORWARD, BACKWARD, RECOMPUTE = ("F", "FS"), "B", "R"

Leaf = tuple[tuple[int, ...], str]  # (shape, dtype name) of one stored array


def base_kind(kind: str) -> str:
    """The action a branch kind runs: the parts of a backward spread over several ticks (`B0`,
    `B1`, ...) are all `B`; `IDLE`, `F`, `FS` and `R` are themselves."""
    return "B" if kind.startswith("B") else kind


# --- FLOPs ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StageFlops:
    """Per physical stage, GEMM FLOPs of one step (each array [S])."""

    forward: np.ndarray
    backward: np.ndarray
    recompute_r: np.ndarray  # R / RrG branches: whole-stage recompute before the backward
    recompute_b: np.ndarray  # inside the backward: backward - 2 x forward
    branch: dict[tuple[str, int], float]  # FLOPs of one run of each branch

    @property
    def recompute(self) -> np.ndarray:
        return self.recompute_r + self.recompute_b

    @property
    def recompute_ratio(self) -> np.ndarray:
        """Recompute over forward, per stage (0 where a stage has no forward)."""
        return np.divide(self.recompute, self.forward, out=np.zeros_like(self.forward),
                         where=self.forward > 0)

    def to_json(self) -> dict:
        return {"forward": self.forward.tolist(), "backward": self.backward.tolist(),
                "recompute_r": self.recompute_r.tolist(),
                "recompute_b": self.recompute_b.tolist(),
                "recompute": self.recompute.tolist(),
                "recompute_ratio": self.recompute_ratio.tolist(),
                "branch": [{"kind": k, "virtual_stage": j, "flops": f}
                           for (k, j), f in self.branch.items()]}


def stage_flops(program: Program, plan: Plan, loop: TickLoop | None = None) -> StageFlops:
    """Forward, backward and recompute FLOPs of each stage over one step (`StageFlops`)."""
    loop = loop or find_tick_loop(program, plan)
    if loop is None:
        raise ValueError("no tick loop matching the plan in the program")
    flops = np.array([program.flops_of(c) for c in loop.branches])
    kinds = np.array([base_kind(k) for k, _ in plan.branches])
    idx = plan.rows[..., BRANCH]  # [T, S]
    per, kind = flops[idx], kinds[idx]

    def total(*which):
        return np.where(np.isin(kind, which), per, 0.0).sum(axis=0)

    fwd, bwd = total(*FORWARD), total(BACKWARD)
    return StageFlops(forward=fwd, backward=bwd, recompute_r=total(RECOMPUTE),
                      recompute_b=bwd - 2 * fwd,
                      branch={kb: float(f) for kb, f in zip(plan.branches, flops, strict=True)})


# --- Memory ---------------------------------------------------------------------------------------


_HLO_DTYPE = {"bool": "pred", "bfloat16": "bf16", "float16": "f16", "float32": "f32",
              "float64": "f64", "int8": "s8", "uint8": "u8", "int16": "s16", "int32": "s32",
              "uint32": "u32", "int64": "s64"}


def _nbytes(dims: Sequence[int], dtype: str) -> int:
    """Bytes of an array of `dims` and `dtype` (numpy's name or HLO's)."""
    return int(math.prod(dims) * DTYPE_BYTES[_HLO_DTYPE.get(dtype, dtype)])


@dataclasses.dataclass(frozen=True)
class Pool:
    """One pool buffer: `rows` leaves of `leaf`'s shape, and the buffer the compiled tick loop
    carries for it (None when none matched)."""

    leaf: Leaf
    rows: int
    compiled: tuple[int, ...] | None  # its dims in the compiled loop carry (per device)

    @property
    def leaf_bytes(self) -> int:
        """Per-device bytes of one leaf, from the compiled buffer; 0 where the compiled loop
        carries none (XLA folded it, e.g. a residual that is a constant)."""
        if self.compiled is None:
            return 0
        return _nbytes(self.compiled, self.leaf[1]) // self.rows


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """What each stage's device holds in the residual and stash pools (`held`), the pools the
    SPMD program allocates on every device (`pool_bytes`), and XLA's per-device peak."""

    plan: Plan
    pools: tuple[Pool, ...]
    held: tuple[int, ...]  # per device: bytes its own slots hold
    residual_bytes: tuple[int, ...]  # per virtual stage: one micro-batch's residuals
    stash_bytes: tuple[int, ...]  # per virtual stage: one stashed input
    peak_bytes: int  # XLA's memory analysis of the whole program (per device)

    @property
    def pool_bytes(self) -> int:
        return sum(p.rows * p.leaf_bytes for p in self.pools)

    @property
    def common_bytes(self) -> int:
        """Everything but the pools: the same on every device."""
        return self.peak_bytes - self.pool_bytes

    @property
    def stage_peak(self) -> tuple[int, ...]:
        return tuple(self.common_bytes + h for h in self.held)

    @property
    def unmatched(self) -> tuple[Pool, ...]:
        return tuple(p for p in self.pools if p.compiled is None)

    def to_json(self) -> dict:
        return {"held_bytes": list(self.held), "stage_peak_bytes": list(self.stage_peak),
                "residual_bytes": list(self.residual_bytes),
                "stash_bytes": list(self.stash_bytes),
                "res_slots": list(self.plan.res_slots),
                "stash_slots": list(self.plan.stash_slots),
                "pool_bytes": self.pool_bytes, "common_bytes": self.common_bytes,
                "peak_bytes": self.peak_bytes,
                "pools": [{"leaf": list(p.leaf[0]), "dtype": p.leaf[1], "rows": p.rows,
                           "compiled": None if p.compiled is None else list(p.compiled)}
                          for p in self.pools]}


def _carry_arrays(program: Program, loop: TickLoop) -> list[tuple[tuple[int, ...], str]]:
    """(dims, HLO dtype) of every array the tick loop carries."""
    return [(tuple(a.dims), a.dtype) for a in parse_shapes(loop.loop.type_text)]


def _match(rows: int, leaf: Leaf, carry: list, taken: collections.Counter,
           divisors: Sequence[int]) -> tuple[int, ...] | None:
    """The carried buffer of `rows` x `leaf`: the same dims, else the same rank with each dim
    the leaf's or the leaf's over one of `divisors` (a mesh axis sharding it)."""
    shape, dtype = leaf
    want = (rows, *shape)
    hlo_dtype = _HLO_DTYPE.get(dtype, dtype)
    free = collections.Counter(carry) - taken
    if free[(want, hlo_dtype)] > 0:
        return want
    fits = [dims for (dims, dt), n in free.items() if n > 0 and dt == hlo_dtype
            and len(dims) == len(want) and dims[0] == rows
            and all(c == w or (c and w % c == 0 and w // c in divisors)
                    for c, w in zip(dims[1:], want[1:], strict=True))]
    return fits[0] if len(fits) == 1 else None


def stage_memory(program: Program, plan: Plan, residuals: Mapping[int, Sequence[Leaf]],
                 stashes: Mapping[int, Sequence[Leaf]], peak_bytes: int,
                 loop: TickLoop | None = None, divisors: Sequence[int] = ()) -> StageMemory:
    """Per-stage pool bytes of `program` under `plan`. `residuals[j]` / `stashes[j]`: the leaves
    one micro-batch of virtual stage j stores (as the executor lays them out); each pool is
    matched to the buffer the compiled tick loop carries (`divisors`: the sizes of the mesh axes
    that may shard a leaf inside the loop, e.g. `tensor`). The pools are the executor's own layout
    (`pools.pool_layout`)."""
    loop = loop or find_tick_loop(program, plan)
    V = plan.virtual
    lay = pool_layout(plan, {j: [residuals[j]] for j in range(V)}, stashes)
    carry = _carry_arrays(program, loop) if loop else []
    taken: collections.Counter = collections.Counter()
    pools = []
    for leaf in sorted(k for k, n in lay.size.items() if n):
        dims = _match(lay.size[leaf], leaf, carry, taken, divisors)
        if dims is not None:
            taken[(dims, _HLO_DTYPE.get(leaf[1], leaf[1]))] += 1
        pools.append(Pool(leaf, lay.size[leaf], dims))
    per_leaf = {p.leaf: p.leaf_bytes for p in pools}

    def leaf_bytes(leaf) -> int:
        return per_leaf.get(plan.pool_key(*leaf), 0)

    held = tuple(sum(n * per_leaf.get(key, 0) for key, n in used.items()) for used in lay.held)
    res = tuple(sum(leaf_bytes(leaf) for leaf in residuals[j]) for j in range(V))
    stash = tuple(sum(leaf_bytes(leaf) for leaf in stashes[j]) for j in range(V))
    return StageMemory(plan, tuple(pools), held, res, stash, int(peak_bytes))
