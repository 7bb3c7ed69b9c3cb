"""The fused tick table's placement: which run of each stage's actions shares each tick.

In one SPMD program every tick lasts as long as its slowest stage's work, and transfers move
only between ticks. A fused tick lets a stage run several of its next actions in a row (up to
`lanes`, the kinds of work its schedule has: forward, recompute, backward, weight gradient), so
the program's step is

    sum over ticks of (max over stages of the work its run does that tick) + PER_TICK,

and the placement is a shortest path: a state is how many actions each stage has done when a
tick starts; a tick moves every stage along a run whose inputs from other devices were made in
earlier ticks, sending at most K activations and K gradients (one `ppermute` each way a tick
carries K; `table._fused` searches K = 1 and 2 and takes 2 where it saves more than PER_SEND a
tick). Doing more work in a tick is never worse (a later action's inputs only arrive sooner),
so for each candidate tick length D (the cost of some stage's run) every stage takes the
longest run that fits D: S * lanes successors a state. A* finds the optimum, bounding what is
left by the longest chain of work from the state (a stage's next action, what it still waits
for on other devices, and every action that must follow it, on its stage or a reader's): no
lockstep placement is shorter than its event-model critical path. Lists of more than
`EXACT_STAGES` stages or `EXACT` actions, or a search past `BUDGET` states, take the greedy
placement instead (each tick every stage's longest run of at most one action of each kind), so
the planner, which asks for the tables of many schedules, never waits long (S=16, M=128: 0.05
s).

Costs are the unit costs of `events.Costs()` (F = R = 1, B = 2): the table is chosen before
anything is compiled, and the runtime and the planner must run and price the same one. With
them Merak's shifted critical path at S=2, M=8 runs in 10 ticks (two activations sent in its
warm-up's second) with a lockstep step of 32 units, its event simulator's makespan (one run a
tick of at most one action per kind took 34, one action a tick 33 in 24 ticks).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from fractions import Fraction

from oases_jax.pipeline.actions import Action

PER_TICK = Fraction(1, 8)  # a tick's own cost (its transfers, the loop) in forwards
# A second activation and gradient in every tick's permutes: one activation's permute is
# 0.2-0.3% of a forward on GPT-2 1.5B over NVLink; priced at about four times that.
PER_SEND = Fraction(1, 128)
# A* places the lists of up to EXACT_STAGES stages and EXACT actions, within BUDGET expanded
# states; others take the greedy placement (from S=8 the search rarely ends within budget, and
# the planner asks for many tables).
EXACT_STAGES, EXACT, BUDGET = 4, 512, 2000
# `events.Costs()`'s unit costs of one micro-batch's work on a whole stage (an interleaved
# chunk's is 1/v of it); a split backward's B takes b - w = 2 and its W w = 0.
UNIT = {"F": 1, "PF": 1, "R": 1, "RrG": 1, "B": 2, "W": 0}
_GROUPS = {"F": 0, "PF": 0, "R": 1, "RrG": 1, "B": 2, "W": 3}


def lanes(actions: Sequence[Sequence[Action]]) -> int:
    """The most actions a stage runs in one fused tick: the kinds of work the lists hold."""
    return max(len({_GROUPS[a.kind] for acts in actions for a in acts}), 1)


def cuts(actions: Sequence[Sequence[Action]], chunks: int,
         order: Sequence[tuple[int, int, tuple[tuple[int, int], ...]]], sends: int = 1
         ) -> tuple[list[tuple[int, ...]], Fraction]:
    """The placement of each stage's list `actions[s]` on fused ticks: per tick boundary (the
    first all zeros, the last every list's length) how many of its actions each stage has done.
    `order`: every action's (stage, index, the (stage, index) of the actions on other devices
    it reads), each after what it reads (`table._order`, which refuses lists that deadlock).
    `sends`: the most activations (and gradients) a stage sends in one tick. Also returns the
    placement's cost: its lockstep step plus PER_TICK a tick, in forwards of a whole stage."""
    search = _Placement(actions, chunks, order, sends)
    path = search.path()
    return path, Fraction(search.step(path), 8 * chunks)


class _Placement:
    """`cuts`'s search over one set of lists: a state is how many actions each stage has done
    when a tick starts. Costs are integers (Fractions are slow in the search): a chunk's
    forward is 8, a whole stage's 8 * chunks."""

    def __init__(self, actions: Sequence[Sequence[Action]], chunks: int,
                 order: Sequence[tuple[int, int, tuple[tuple[int, int], ...]]], sends: int):
        self.actions, self.sends = actions, sends
        self.S = len(actions)
        n = self.n = tuple(len(a) for a in actions)
        cost = self.cost = [[UNIT[a.kind] * 8 for a in acts] for acts in actions]
        self.per_tick = int(PER_TICK * 8 * chunks)
        # remote[s][i]: the actions on other devices that action i of stage s reads.
        self.remote: list[list[tuple[tuple[int, int], ...]]] = [[()] * k for k in n]
        readers: list[list[list[tuple[int, int]]]] = [[[] for _ in range(k)] for k in n]
        for s, i, deps in order:
            self.remote[s][i] = deps
            for p, k in deps:
                readers[p][k].append((s, i))
        # tail[s][i]: the longest chain of work that must follow action i of stage s (the
        # stage's next action, or a reader on another device, and so on): the bound A* searches
        # with.
        tail = self.tail = [[0] * k for k in n]
        for s, i, _ in reversed(order):
            after = [(s, i + 1)] if i + 1 < n[s] else []
            tail[s][i] = max((cost[q][k] + tail[q][k] for q, k in after + readers[s][i]),
                             default=0)
        self.cap = lanes(actions)

    def runs(self, state: tuple[int, ...], s: int) -> list[int]:
        """Cumulative costs of stage s's possible runs this tick (index = run length)."""
        n, remote, cost = self.n, self.remote, self.cost
        out, i, total, sent = [0], state[s], 0, {"act": 0, "grad": 0}
        while i < n[s] and len(out) <= self.cap:
            if any(state[p] <= k for p, k in remote[s][i]):
                break
            for x in self.actions[s][i].sends:
                sent[x.kind] += 1
                if sent[x.kind] > self.sends:
                    return out
            total += cost[s][i]
            out.append(total)
            i += 1
        return out

    def bound(self, state: tuple[int, ...]) -> int:
        """No placement from `state` is shorter than any stage's next action, the chain of
        work behind it, and what that action still waits for on other devices."""
        n, remote, cost, tail = self.n, self.remote, self.cost, self.tail
        out = 0
        for s in range(self.S):
            i = state[s]
            if i < n[s]:
                wait = max((sum(cost[p][state[p]:k + 1]) for p, k in remote[s][i]
                            if state[p] <= k), default=0)
                out = max(out, wait + cost[s][i] + tail[s][i])
        return out

    def successors(self, state: tuple[int, ...]):
        """(cost, next state) of each candidate tick length D: every stage's longest run that
        fits D."""
        options = [self.runs(state, s) for s in range(self.S)]
        for D in sorted({x for run in options for x in run[1:]}):
            yield D + self.per_tick, tuple(state[s] + max(k for k, x in enumerate(run) if x <= D)
                                           for s, run in enumerate(options))

    def exact(self) -> dict | None:
        """A*, or None past BUDGET expanded states."""
        start = (0,) * self.S
        best, back = {start: 0}, {}
        # Among equal priorities the deepest state first: the ties of a periodic steady state
        # are not all expanded.
        heap = [(self.bound(start), 0, 0, start)]
        pushed = expanded = 0
        while heap:
            f, _, _, state = heapq.heappop(heap)
            g = best[state]
            if f > g + self.bound(state):
                continue  # a stale entry
            if state == self.n:
                return back
            expanded += 1
            if expanded > BUDGET:
                return None
            for cost_, nxt in self.successors(state):
                ng = g + cost_
                if ng < best.get(nxt, ng + 1):
                    best[nxt], back[nxt] = ng, state
                    pushed += 1
                    heapq.heappush(heap, (ng + self.bound(nxt), -ng, pushed, nxt))
        raise ValueError("the action lists deadlock")  # `table._order` refuses them first

    def greedy(self) -> list[tuple[int, ...]]:
        """Tick by tick, every stage's longest run of at most one action of each kind."""
        state, path = (0,) * self.S, [(0,) * self.S]
        while state != self.n:
            nxt = []
            for s in range(self.S):
                kinds, run = set(), self.runs(state, s)
                k = 0
                while k + 1 < len(run) and _GROUPS[self.actions[s][state[s] + k].kind] not in kinds:
                    kinds.add(_GROUPS[self.actions[s][state[s] + k].kind])
                    k += 1
                nxt.append(state[s] + k)
            state = tuple(nxt)
            path.append(state)
        return path

    def path(self) -> list[tuple[int, ...]]:
        """The tick boundaries: A*'s where the lists are small enough and it ends within
        BUDGET, else the greedy placement's."""
        back = self.exact() if self.S <= EXACT_STAGES and sum(self.n) <= EXACT else None
        if back is None:
            return self.greedy()
        path = [self.n]
        while any(path[-1]):
            path.append(back[path[-1]])
        path.reverse()
        return path

    def step(self, path: list[tuple[int, ...]]) -> int:
        """The lockstep step of `path` plus `per_tick` a tick, in integer costs."""
        return sum(max(sum(self.cost[s][a[s]:b[s]]) for s in range(self.S)) + self.per_tick
                   for a, b in itertools.pairwise(path))
