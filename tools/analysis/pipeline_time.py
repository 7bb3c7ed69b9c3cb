"""Time a compiled pipelined program tick by tick (docs/inspection.md, "Timing a pipelined
program").

The executor (`oases_jax.pipeline.executor`) runs a schedule's tick table as one `lax.scan` over
the T ticks; in each tick every stage runs, lane by lane (one lane unfused; in a fused table
lane k holds the k-th action of a stage's run that tick), `lax.switch(row[BRANCH], branches)`
on its own row, and one activation and one gradient permute follow outside the switches. The
whole-program simulator replays a conditional by its first branch, so it cannot tell what a
device runs each tick. Here
the tick loop is found (the while loop of T trips whose body holds one conditional per lane, in
lane order, each with one branch computation per `Plan.branches`, in lax.switch's order: XLA's
`branch_computations[i]` runs for index i), each branch computation (of the lane it runs in) and
the rest of the tick body are priced alone by the simulator (`Simulator.replay`), and the plan's
rows say which branch each stage runs in each lane:

    tick_t = rest + max_s sum_lanes cost[rows[t, lane, s, BRANCH]]   (SPMD: the slowest stage)
    loop   = sum_t tick_t;  step = outside the loop + loop

Per stage: busy = sum_t cost of its non-idle branches, idle fraction = 1 - busy / switch time
(switch time = sum_t max_s cost). Beside it, the event simulator (`pipeline.events`, stages
running ahead asynchronously) and `lockstep_makespan` with F/B/R costs taken from the branches.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oases_jax.hardware import ClusterSpec
from oases_jax.pipeline import events
from oases_jax.pipeline.executor import BRANCH, Plan, base_kind
from oases_jax.tools.analysis.hlo import Instr
from oases_jax.tools.analysis.program import Program
from oases_jax.tools.analysis.simulate import SimResult, Simulator


@dataclasses.dataclass(frozen=True)
class TickLoop:
    loop: Instr  # the while
    body: str  # its body computation
    switches: tuple[Instr, ...]  # the conditional of each lane
    branches: tuple[str, ...]  # branch computations, in Plan.branches' order
    heads: tuple[Instr, ...] = ()  # a split head's conditionals (`executor.HeadProgram`)


def find_tick_loop(program: Program, plan: Plan) -> TickLoop | None:
    """The while loop of `plan.n_ticks` trips whose body (or a call inside it) holds one
    conditional per lane with `len(plan.branches)` branch computations (the first that many, in
    program order, which is lane order: each lane's switch takes the state the one before
    returns); None when there is none. A branch is priced in the lane it runs in."""
    T, n = plan.n_ticks, len(plan.branches)
    module = program.module
    for comp, _ in program.walk():
        for instr in comp.instrs:
            if instr.opcode != "while" or module.trip_count(instr) != T:
                continue
            body = (instr.attr("body") or "").lstrip("%")
            conds = list(_conditionals(program, body))
            switches = [c for c in conds if len(c.called) == n]
            if len(switches) < plan.lanes:
                continue
            switches = switches[:plan.lanes]
            used = plan.lane_rows()[..., BRANCH]  # [T, lanes, S]
            lane_of = [next((lane for lane in range(plan.lanes) if (used[:, lane] == g).any()),
                            0) for g in range(n)]
            branches = tuple(switches[lane_of[g]].called[g] for g in range(n))
            # A split head's phases: the body's other conditionals (`lax.cond`: true, false),
            # one per phase a tick may run (`Plan.heads`).
            heads = tuple(c for c in conds if c not in switches
                          and len(c.called) == 2) if plan.head else ()
            return TickLoop(instr, body, tuple(switches), branches, heads)
    return None


def _conditionals(program: Program, comp_name: str):
    for instr in program.comp(comp_name).instrs:
        if instr.opcode == "conditional":
            yield instr
        elif instr.opcode == "call":
            for c in instr.called:
                yield from _conditionals(program, c)


@dataclasses.dataclass
class PipelineTime:
    plan: Plan
    loop: TickLoop
    branch: list[SimResult]  # per branch of Plan.branches
    rest: SimResult  # one tick body without the conditional (the permutes, buffer updates)
    outside: SimResult  # the program without the tick loop
    head: SimResult | None = None  # one split-head phase (its conditional's true branch)

    @property
    def head_ticks(self) -> np.ndarray:
        """[T] the split head's phases run after each tick."""
        return self.plan.head_phases()

    @property
    def head_s(self) -> float:
        """The split head's phases over the step (0 without one)."""
        return float(self.head.step_s * self.head_ticks.sum()) if self.head else 0.0

    @property
    def cost(self) -> np.ndarray:
        return np.array([b.step_s for b in self.branch])

    @property
    def per_lane(self) -> np.ndarray:
        """[T, lanes, S] time of each stage's branch in each lane."""
        return self.cost[self.plan.lane_rows()[..., BRANCH]]

    @property
    def per_tick(self) -> np.ndarray:
        """[T, S] time of each stage's work in each tick (its lanes' branches)."""
        return self.per_lane.sum(axis=1)

    @property
    def switch_s(self) -> float:
        return float(self.per_tick.max(axis=1).sum())

    @property
    def ticks_s(self) -> np.ndarray:
        head = self.head.step_s * self.head_ticks if self.head else 0.0
        return self.rest.step_s + self.per_tick.max(axis=1) + head

    @property
    def loop_s(self) -> float:
        return float(self.ticks_s.sum())

    @property
    def busy_s(self) -> np.ndarray:
        busy = np.where(self.plan.lane_rows()[..., BRANCH] > 0, self.per_lane, 0.0)
        return busy.sum(axis=(0, 1))

    @property
    def idle_fraction(self) -> np.ndarray:
        return 1 - self.busy_s / self.switch_s if self.switch_s else np.zeros(self.plan.stages)

    def share(self, kind: str) -> float:
        """`kind` branches' time over all stages' switch time."""
        kinds = np.array([base_kind(k) == kind for k, _ in self.plan.branches])
        sel = kinds[self.plan.lane_rows()[..., BRANCH]]
        total = self.plan.stages * self.switch_s
        return float(np.where(sel, self.per_lane, 0.0).sum() / total) if total else 0.0

    @property
    def exposed_comm_s(self) -> float:
        """Communication not hidden behind compute: the rest's (permutes) every tick, plus that
        of each tick's slowest stage's branches (collectives inside the stage, e.g. tensor
        parallel)."""
        T = self.plan.n_ticks
        slowest = self.plan.lane_rows()[..., BRANCH][np.arange(T), :,
                                                     self.per_tick.argmax(axis=1)]
        inside = sum(self.branch[b].exposed_comm_s for b in slowest.ravel() if b > 0)
        head = self.head.exposed_comm_s * self.head_ticks.sum() if self.head else 0.0
        return T * self.rest.exposed_comm_s + float(inside) + float(head)

    def stage_costs(self) -> events.Costs:
        """Per physical stage, F/B/R of one micro-batch (all its chunks) from the branch costs:
        F from the F branch (FS where a stage has no F); R from the R branch on every stage
        that has one (the others never recompute: their R is never run and is priced as F)."""
        S, V = self.plan.stages, self.plan.virtual
        cost = {kb: c for kb, c in zip(self.plan.branches, self.cost, strict=True)}

        def per_stage(*kinds):
            out = []
            for s in range(S):
                total = 0.0
                for j in range(s, V, S):
                    # The first of `kinds` stage j has; a backward split over several ticks is
                    # the sum of its parts (branches B0, B1, ...).
                    k = next((k for k in kinds if any(base_kind(b) == k and i == j
                                                      for b, i in cost)), None)
                    if k is None:
                        return None
                    total += sum(float(c) for (b, i), c in cost.items()
                                 if base_kind(b) == k and i == j)
                out.append(total)
            return out

        f = per_stage("F", "FS") or 0
        r = per_stage("R", "F", "FS")
        return events.Costs(f=f, b=per_stage("B") or 0, r=r, p2p=0)

    def to_json(self) -> dict:
        p = self.plan
        costs = self.stage_costs()
        timeline = events.simulate(p.schedule, costs)
        lockstep = float(events.lockstep_makespan(p.table, costs))
        makespan = float(timeline.makespan)
        return {
            "schedule": p.schedule.name, "stages": p.stages,
            "microbatches": p.schedule.microbatches, "ticks": p.n_ticks, "lanes": p.lanes,
            "loop": self.loop.loop.name,
            "conditionals": [sw.name for sw in self.loop.switches],
            "branches": [{"kind": k, "virtual_stage": j, "computation": c, "step_s": r.step_s,
                          "compute_s": r.compute_s, "comm_s": r.comm_s}
                         for (k, j), c, r in zip(p.branches, self.loop.branches, self.branch,
                                                 strict=True)],
            "rest_s": self.rest.step_s, "rest_comm_s": self.rest.comm_s,
            "head_phase_s": self.head.step_s if self.head else 0.0,
            "head_phase_comm_s": self.head.comm_s if self.head else 0.0,
            "head_phases": int(self.head_ticks.sum()) if self.head else 0,
            "outside_s": self.outside.step_s,
            "switch_s": self.switch_s, "loop_s": self.loop_s,
            "step_s": self.outside.step_s + self.loop_s,
            "busy_s": self.busy_s.tolist(), "idle_fraction": self.idle_fraction.tolist(),
            # Idle share of the busiest stage, and the mean over stages.
            "bubble": float(self.idle_fraction.min()),
            "mean_idle": float(self.idle_fraction.mean()),
            "recompute_share": self.share("R"),
            "permute_s": p.n_ticks * self.rest.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "events": {"makespan_s": makespan, "lockstep_s": lockstep,
                       "idle_fraction": [float(i / timeline.makespan) if makespan else 0.0
                                         for i in timeline.idle],
                       "bubble": float(timeline.bubble)},
        }


def pipeline_time(program: Program, cluster: ClusterSpec, plan: Plan, *,
                  compute_cost=None, comm_cost=None) -> PipelineTime | None:
    """Price the tick loop of `program` (None when it has none that matches `plan`)."""
    loop = find_tick_loop(program, plan)
    if loop is None:
        return None
    sim = Simulator(program, cluster, max_events=0, compute_cost=compute_cost,
                    comm_cost=comm_cost)
    branch = [sim.replay(c) for c in loop.branches]
    conds = {c.name for c in (*loop.switches, *loop.heads)}
    rest = sim.replay(loop.body, skip=frozenset(conds))
    outside = sim.replay(program.module.entry, skip=frozenset({loop.loop.name}))
    head = sim.replay(loop.heads[0].called[0]) if loop.heads else None
    return PipelineTime(plan, loop, branch, rest, outside, head)
