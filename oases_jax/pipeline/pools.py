"""Where the tick executor keeps what a micro-batch stores between ticks: the residual and stash
pools, one buffer per key (`Plan.pool_key`), and their rows per slot (docs/parallelism.md,
"Pipeline executor"); and the XLA options under which the pools go through the tick's switch
in place (`compiler_options`).

One layout serves the executor (`executor.run` allocates and addresses the pools with it) and the
per-stage memory account of the compiled program (`analysis.pipeline_stages.stage_memory` reads
the rows each device holds), so the two cannot drift apart.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from oases_jax.pipeline.lowering import Plan

__all__ = ["PoolLayout", "compiler_options", "pool_layout"]

Key = tuple  # (dims, dtype name): one pool (`Plan.pool_key`)


def compiler_options(platform: str) -> dict:
    """XLA options of a program the tick executor runs on `platform`: copy insertion by region
    analysis. Without it XLA kept a copy of every pool at the root of every branch of the
    tick's switch, and another after the switch into the loop carry (XLA:CPU always; XLA:GPU
    wherever a mesh axis is left to GSPMD inside the stages, `tensor`): its default live-range
    ordering could not prove a pool that a branch passes on or updates in place dead after the
    switch. GPT-2 1.5B (20 heads, bf16) at data=2,stage=2,tensor=4, M=8 on `h100:16`: 1F1B
    226.6 -> 197.2 ms, interleaved 286.1 -> 204.7 ms; `small` at data=2,stage=2,tensor=2, M=4
    on 8 CPU devices: GPipe 707.1 -> 516.1 ms (docs/parallelism.md, "Pipeline executor")."""
    if platform in ("gpu", "cuda", "rocm"):
        return {"xla_gpu_copy_insertion_use_region_analysis": True}
    if platform == "cpu":
        return {"xla_cpu_copy_insertion_use_region_analysis": True}
    return {}


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The pools of one plan on every device (each device's virtual stages take disjoint rows of
    the same buffers; a buffer has the rows of the device that needs most).

    keys: the pools, sorted; pool i holds leaves of key `keys[i]`.
    size[k]: rows of pool k's buffer (the slots of the device that needs most).
    counts[(what, j)][k]: leaves of key k in one slot of `what` ("res" or "stash") of stage j.
    offsets[(what, j)][k]: the row where those slots start.
    firsts[(what, j, q)][k]: the leaves of key k before part q's within a slot.
    held[d][k]: the rows of pool k that device d's slots use.
    """

    keys: tuple[Key, ...]
    size: Mapping[Key, int]
    counts: Mapping[tuple[str, int], Mapping[Key, int]]
    offsets: Mapping[tuple[str, int], Mapping[Key, int]]
    firsts: Mapping[tuple[str, int, int], Mapping[Key, int]]
    held: tuple[Mapping[Key, int], ...]

    def starts(self, what: str, j: int, q: int, slot) -> dict[int, int]:
        """Per pool index, the row of part q's first leaf in `slot` of `what` of stage j (q=0:
        the whole slot's). `slot` may be a traced index."""
        return {self.keys.index(k): self.offsets[(what, j)][k] + slot * n
                + self.firsts[(what, j, q)].get(k, 0)
                for k, n in self.counts[(what, j)].items() if n}

    def leaf_rows(self, what: str, j: int, q: int, keys: Sequence[Key], base_q: int,
                  at: Mapping[int, Any]) -> list[tuple[int, Any]]:
        """Per leaf of part q (of `keys`, in order), (pool index, row): `at[pool]` is the row of
        part base_q's first leaf, and each leaf adds its place after it."""
        seen = {k: self.firsts[(what, j, q)].get(k, 0) - self.firsts[(what, j, base_q)].get(k, 0)
                for k in self.counts[(what, j)]}
        out = []
        for k in keys:
            i = self.keys.index(k)
            out.append((i, at[i] + seen[k]))
            seen[k] += 1
        return out

def _shape_dtype(leaf) -> tuple[tuple[int, ...], str]:
    if hasattr(leaf, "shape"):
        return tuple(leaf.shape), np.dtype(leaf.dtype).name
    shape, dtype = leaf
    return tuple(shape), np.dtype(dtype).name


def pool_layout(p: Plan, residuals: Mapping[int, Sequence[Sequence]],
                stashes: Mapping[int, Sequence]) -> PoolLayout:
    """The pools of plan `p`. `residuals[j][q]`: the leaves part q of virtual stage j stores per
    micro-batch (a slot holds all the stage's parts, part after part); `stashes[j]`: what a
    recomputed micro-batch of stage j keeps (its input)."""
    def key(leaf) -> Key:
        return p.pool_key(*_shape_dtype(leaf))

    counts, offsets, firsts = {}, {}, {}
    size: dict[Key, int] = {}
    held = []
    for d in range(p.stages):
        used: collections.Counter = collections.Counter()
        for j in range(d, p.virtual, p.stages):
            for what, parts, slots in (("res", residuals[j], p.res_slots[j]),
                                       ("stash", [stashes[j]], p.stash_slots[j])):
                per: collections.Counter = collections.Counter()
                for q, leaves in enumerate(parts):
                    firsts[(what, j, q)] = dict(per)
                    per.update(key(leaf) for leaf in leaves)
                counts[(what, j)] = dict(per)
                offsets[(what, j)] = {k: used[k] for k in per}
                for k, n in per.items():
                    used[k] += n * slots
        held.append(dict(used))
        for k, n in used.items():
            size[k] = max(size.get(k, 0), n)
    return PoolLayout(tuple(sorted(size)), size, counts, offsets, firsts, tuple(held))
