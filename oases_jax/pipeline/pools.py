"""Where the tick executor keeps what a micro-batch stores between ticks: the residual and stash
pools, one buffer per key (`Plan.pool_key`), their rows per slot, and in the blocks mode the
per-tick rows each stage reads and writes (docs/parallelism.md, "Pipeline executor").

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

from oases_jax.pipeline.lowering import BRANCH, SLOT_IN, SLOT_OUT, Plan

__all__ = ["PoolLayout", "pool_blocks", "pool_layout"]

Key = tuple  # (dims, dtype name): one pool (`Plan.pool_key`)


def pool_blocks(platform: str, p: Plan) -> bool:
    """Whether the executor keeps the residual pools out of the tick's switch: on CPU devices,
    where a device's pools hold more than three slots. XLA:CPU copied every pool that went
    through the switch whole, every tick (`small`, stage=2,tensor=4, GPipe M=16: 39 MiB a tick
    per device, the step 1469.7 ms, 530.8 ms with blocks); blocks pass over three slots a tick,
    which is more than that copy at 1F1B's two (4,590 against 4,295 tokens/s). XLA:GPU copies
    less, and there the blocks cost more than they save (docs/parallelism.md)."""
    slots = max(sum(p.res_slots[j] + p.stash_slots[j] for j in range(d, p.virtual, p.stages))
                for d in range(p.stages))
    return platform == "cpu" and slots > 3


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The pools of one plan on every device (each device's virtual stages take disjoint rows of
    the same buffers; a buffer has the rows of the device that needs most).

    keys: the pools, sorted; pool i holds leaves of key `keys[i]`.
    size[k]: rows of the slots in pool k; `rows(k)` adds the spare block in the blocks mode.
    block[k]: rows of one block, the most leaves of key k one slot of any user holds.
    counts[(what, j)][k]: leaves of key k in one slot of `what` ("res" or "stash") of stage j.
    offsets[(what, j)][k]: the row where those slots start.
    firsts[(what, j, q)][k]: the leaves of key k before part q's within a slot.
    held[d][k]: the rows of pool k that device d's slots use.
    """

    keys: tuple[Key, ...]
    size: Mapping[Key, int]
    block: Mapping[Key, int]
    counts: Mapping[tuple[str, int], Mapping[Key, int]]
    offsets: Mapping[tuple[str, int], Mapping[Key, int]]
    firsts: Mapping[tuple[str, int, int], Mapping[Key, int]]
    held: tuple[Mapping[Key, int], ...]
    blocks: bool

    def rows(self, k: Key) -> int:
        """Rows of pool k's buffer: its slots, and the spare block in the blocks mode."""
        return self.size[k] + (self.block[k] if self.blocks else 0)

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

    def block_rows(self, p: Plan, parts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The blocks mode's rows, int32 [T, S, K]: per tick, stage and pool, where the block a
        stage's branch reads starts, and where the one it writes does; a tick that reads (or
        writes) nothing of a pool points at its spare block."""
        T, S, K = len(p.rows), p.stages, len(self.keys)
        rd = np.array([[self.size[k] for k in self.keys]] * (T * S), np.int32).reshape(T, S, K)
        wr = rd.copy()
        for t in range(T):
            for d in range(S):
                r = p.rows[t][d]
                kind, j = p.branches[r[BRANCH]]
                reads, writes = {}, {}
                if kind == "F":
                    writes = self.starts("res", j, 0, r[SLOT_OUT])
                elif kind == "FS":
                    writes = self.starts("stash", j, 0, r[SLOT_OUT])
                elif kind == "R":
                    reads = self.starts("stash", j, 0, r[SLOT_IN])
                    writes = self.starts("res", j, 0, r[SLOT_OUT])
                elif kind.startswith("B"):
                    q = parts[j] - 1 - int(kind[1:] or 0)
                    reads = self.starts("res", j, q, r[SLOT_IN])
                for i, at in reads.items():
                    rd[t, d, i] = at
                for i, at in writes.items():
                    wr[t, d, i] = at
        return rd, wr


def _shape_dtype(leaf) -> tuple[tuple[int, ...], str]:
    if hasattr(leaf, "shape"):
        return tuple(leaf.shape), np.dtype(leaf.dtype).name
    shape, dtype = leaf
    return tuple(shape), np.dtype(dtype).name


def pool_layout(p: Plan, residuals: Mapping[int, Sequence[Sequence]],
                stashes: Mapping[int, Sequence], *, blocks: bool) -> PoolLayout:
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
    keys = tuple(sorted(size))
    block = {k: max(c.get(k, 0) for c in counts.values()) for k in keys}
    return PoolLayout(keys, size, block, counts, offsets, firsts, tuple(held), blocks)
