"""A schedule lowered to what the pipeline executor reads (`oases_jax.pipeline.executor`): per
tick and stage the branch to run and the slots it reads and writes, with every slot (residuals,
stashed inputs, receive buffers) allocated offline, first-fit. Pure Python: built and checked
without devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from oases_jax.errors import UserError
from oases_jax.pipeline import registry
from oases_jax.pipeline.actions import Action, vstage
from oases_jax.pipeline.table import Schedule, TickTable

# Columns of a plan row (one per tick and stage). HEAD_MB and HEAD_STORE (split head only): the
# micro-batch whose head runs after this tick (-1: none; the same on every device; the k-th
# head after a tick in its row L-1-k, as arrivals) and the receive slot its output gradient goes
# to on the last virtual stage's device.
BRANCH, MB, SLOT_IN, SLOT_OUT, ACT_READ, GRAD_READ, ACT_STORE, GRAD_STORE, HEAD_MB, HEAD_STORE \
    = range(10)
# FS: a forward that stashes its input for a recompute; a backward spread over k ticks runs as
# branches B0 .. B<k-1> (`base_kind` maps them back to B).
KINDS = ("IDLE", "F", "FS", "R", "B")


def base_kind(kind: str) -> str:
    """The action kind of a branch kind: `B1` (part 1 of a split backward) -> `B`."""
    return "B" if kind.startswith("B") else kind


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule compiled to what the executor reads: `branches[i]` = (kind, virtual stage) of
    branch i (0 is IDLE), `rows[t][s]` the eight columns above, and per device the slots each
    buffer needs. Pure Python: built and checked without devices."""

    schedule: Schedule
    branches: tuple[tuple[str, int], ...]
    rows: np.ndarray  # int32 [T, S, 10]
    res_slots: tuple[int, ...]  # per virtual stage: residual slots
    stash_slots: tuple[int, ...]  # per virtual stage: stashed-input slots
    act_slots: int  # receive-buffer slots (the same count on every device: SPMD shapes)
    grad_slots: int
    table: TickTable  # what the rows were lowered from (backward spans included)
    head: bool = False  # the head runs split over every stage after the tick of its input

    @property
    def lanes(self) -> int:
        return self.table.lanes

    @property
    def n_ticks(self) -> int:
        return self.table.n_ticks

    def head_phases(self) -> np.ndarray:
        """[T] the split-head phases run after each tick (zeros without a split head)."""
        return (self.lane_rows()[:, :, 0, HEAD_MB] >= 0).sum(axis=1)

    @property
    def heads(self) -> int:
        """The most split-head phases after one tick (0 without a split head)."""
        return int(self.head_phases().max(initial=0))

    def lane_rows(self) -> np.ndarray:
        """The rows as [T, lanes, S, 8]: tick t runs lane 0's switch, then lane 1's, ..."""
        return self.rows.reshape(self.n_ticks, self.lanes, *self.rows.shape[1:])

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def virtual(self) -> int:
        return self.schedule.virtual

    @property
    def wraps(self) -> bool:
        return self.schedule.chunks > 1

    def pool_key(self, shape, dtype) -> tuple:
        """The pool a stored leaf of `shape` and `dtype` goes to: one pool per leaf shape and
        dtype, in the leaf's own shape. (Pools of flattened leaves, once used with several
        chunks a device, cost more than they saved once the executor loaded slots with a
        gather: `executor.run`.)"""
        return tuple(shape), np.dtype(dtype).name


class _Slots:
    """First-fit slot allocation; `peak` is the slots ever used at once."""

    def __init__(self):
        self.free: list[int] = []
        self.used = 0

    def take(self) -> int:
        if self.free:
            self.free.sort()
            return self.free.pop(0)
        self.used += 1
        return self.used - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


def plan(schedule: Schedule, backward_ticks: int | tuple[int, ...] = 1,
         fuse: bool = False, head: bool = False) -> Plan:
    """Lower a schedule's tick table to executor rows with statically allocated slots. A
    backward of virtual stage j spans `backward_ticks[j]` ticks (`TickTable`): branch `B<p>`
    runs its part p, all parts read the one residual slot, part 0 the received gradient.
    `fuse`: the fused table (`tick_table`), one row per lane of each tick (lane k the k-th
    action of a stage's run that tick). `head`: the head runs on every stage (each its share)
    after the tick where the last virtual stage's forward made its input; its output gradient
    is stored like a received gradient, which that stage's backward reads in a later tick."""
    if schedule.split_backward:
        raise UserError(f"the {schedule.name} schedule splits the backward into B and W, which "
                        f"the executor does not run yet: use "
                        f"{', '.join(registry.names(executor='ticks'))}")
    lowering = _Lowering(schedule, schedule.ticks(backward_ticks, fuse, head), head)
    L = lowering.table.lanes
    for t, row in enumerate(lowering.table.ticks):
        lowering.assign(t, row)
        # Slots read this tick are free before this tick's arrivals are stored.
        lowering.release(t, row)
        lowering.store_arrivals(t)
        if head and t % L == L - 1:
            lowering.store_heads(t)
    return lowering.finish()


class _Lowering:
    """`plan`'s state as it walks the table tick by tick: the branches met so far, the rows,
    the slot pools (residuals and stashed inputs per virtual stage, receive buffers per device)
    and the slot each live value holds, keyed by (mb, virtual stage)."""

    def __init__(self, schedule: Schedule, table: TickTable, head: bool):
        self.schedule, self.table, self.head = schedule, table, head
        S, V = self.S, self.V = schedule.stages, schedule.virtual
        self.recomputed = schedule.recomputed()
        self.branches: list[tuple[str, int]] = [("IDLE", -1)]
        self.index: dict[tuple[str, int], int] = {}
        T = len(table.ticks)
        self.rows = np.zeros((T, S, 10), np.int32)
        self.rows[..., HEAD_MB] = -1
        self.res = [_Slots() for _ in range(V)]
        self.stash = [_Slots() for _ in range(V)]
        self.act = [_Slots() for _ in range(S)]
        self.grad = [_Slots() for _ in range(S)]
        self.held_res: dict[tuple[int, int], int] = {}
        self.held_stash: dict[tuple[int, int], int] = {}
        self.held_act: dict[tuple[int, int], int] = {}  # (mb, receiving virtual stage) -> slot
        self.held_grad: dict[tuple[int, int], int] = {}
        # rows that store an arrival (activations, gradients)
        self.stored = np.zeros((T, S), bool), np.zeros((T, S), bool)

    def branch(self, kind: str, j: int) -> int:
        """The index of branch (kind, virtual stage j), added on first use."""
        if (kind, j) not in self.index:
            self.index[(kind, j)] = len(self.branches)
            self.branches.append((kind, j))
        return self.index[(kind, j)]

    def assign(self, t: int, row: Sequence[Action]) -> None:
        """Row t's branches and the slots its actions read and write."""
        S, V, table = self.S, self.V, self.table
        for s, a in enumerate(row):
            r = self.rows[t, s]
            if a.kind == "IDLE":
                continue
            j = vstage(s, a, S)
            key = (a.mb, j)
            r[MB] = a.mb
            if a.kind in ("F", "PF"):
                stashes = key in self.recomputed
                r[BRANCH] = self.branch("FS" if stashes else "F", j)
                pool, held = (self.stash, self.held_stash) if stashes \
                    else (self.res, self.held_res)
                held[key] = r[SLOT_OUT] = pool[j].take()
                if j > 0:
                    r[ACT_READ] = self.held_act.pop(key)
            elif a.kind in ("R", "RrG"):
                r[BRANCH] = self.branch("R", j)
                r[SLOT_IN] = self.held_stash.pop(key)
                self.held_res[key] = r[SLOT_OUT] = self.res[j].take()
            elif a.kind == "B":
                part, k = table.part(t, s), table.span(j)
                r[BRANCH] = self.branch("B" if k == 1 else f"B{part}", j)
                r[SLOT_IN] = self.held_res[key]
                if part == 0 and (j + 1 < V or self.head):
                    r[GRAD_READ] = self.held_grad.pop(key)
            else:
                raise UserError(f"the executor has no {a.kind} action (schedule "
                                f"{self.schedule.name})")

    def release(self, t: int, row: Sequence[Action]) -> None:
        """Free the slots row t's actions read last."""
        S, V, table = self.S, self.V, self.table
        for s, a in enumerate(row):
            if a.kind == "IDLE":
                continue
            j = vstage(s, a, S)
            r = self.rows[t, s]
            if a.kind in ("F", "PF") and j > 0:
                self.act[s].give(int(r[ACT_READ]))
            if a.kind in ("R", "RrG"):
                self.stash[j].give(int(r[SLOT_IN]))
            if a.kind == "B":
                part, k = table.part(t, s), table.span(j)
                if part == k - 1:
                    self.res[j].give(int(self.held_res.pop((a.mb, j))))
                if part == 0 and (j + 1 < V or self.head):
                    self.grad[s].give(int(r[GRAD_READ]))

    def store_arrivals(self, t: int) -> None:
        """The k-th arrival of a kind on a device after tick row t (the tick's last lane) is
        stored at the slot in row t-k's column (a device receives from one neighbour, in the
        order that neighbour's lanes sent)."""
        arrived: dict[tuple[str, int], int] = {}
        for x in self.table.transfers[t]:
            d = x.dst % self.S
            k = arrived[(x.kind, d)] = arrived.get((x.kind, d), -1) + 1
            self.stored[x.kind != "act"][t - k, d] = True
            slots, held, col = ((self.act, self.held_act, ACT_STORE) if x.kind == "act"
                                else (self.grad, self.held_grad, GRAD_STORE))
            held[(x.mb, x.dst)] = self.rows[t - k, d, col] = slots[d].take()

    def store_heads(self, t: int) -> None:
        """The heads after tick row t (its last lane's row), in lane order: each output
        gradient waits in the last stage's receive buffer (its own column: an interleaved
        device may also receive a gradient this tick)."""
        S, V, L = self.S, self.V, self.table.lanes
        d = (V - 1) % S
        finals = [a for lane in self.table.ticks[t - L + 1:t + 1] for a in [lane[d]]
                  if a.kind in ("F", "PF") and vstage(d, a, S) == V - 1]
        for k, a in enumerate(finals):
            self.rows[t - k, :, HEAD_MB] = a.mb
            self.held_grad[(a.mb, V - 1)] = self.rows[t - k, d, HEAD_STORE] = self.grad[d].take()

    def finish(self) -> Plan:
        """The plan, once every tick is lowered."""
        rows, S, V = self.rows, self.S, self.V
        act_slots = max(a.used for a in self.act)
        grad_slots = max(g.used for g in self.grad)
        # Rows with no arrival store into a scratch slot past the real ones.
        rows[..., ACT_STORE] = np.where(self.stored[0], rows[..., ACT_STORE], act_slots)
        rows[..., GRAD_STORE] = np.where(self.stored[1], rows[..., GRAD_STORE], grad_slots)
        heads = rows[:, :1, HEAD_MB] >= 0  # rows that run a head after their tick
        rows[..., HEAD_STORE] = np.where(heads & (np.arange(S) == (V - 1) % S),
                                         rows[..., HEAD_STORE], grad_slots)
        return Plan(self.schedule, tuple(self.branches), rows, tuple(r.used for r in self.res),
                    tuple(s.used for s in self.stash), act_slots, grad_slots, self.table,
                    self.head)
