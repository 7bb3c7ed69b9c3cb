"""The tick-by-tick time of a compiled pipelined program (`analysis.pipeline_time`) against hand
arithmetic on the plan's table and the event simulator, with hand-set costs on a tiny CPU
compile; and XLA's order of a conditional's branch computations against lax.switch's index."""

from __future__ import annotations

import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import pytest

from oases_jax.hardware import get_cluster
from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.pipeline import events, executor
from oases_jax.pipeline import registry as pipeline_registry
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.tools.analysis import hlo
from oases_jax.tools.analysis.pipeline_time import find_tick_loop, pipeline_time
from oases_jax.tools.analysis.program import Program
from oases_jax.training import ParallelConfig
from oases_jax.training.program import CompileSpec, lower

MESH = "data=2,stage=2"
CFG = get_preset("tiny").replace(n_layers=2, d_model=64, d_ff=128)
UNARY = ("sine", "cosine", "exponential", "tanh")


def _opcodes(module, name, seen=None):
    seen = set() if seen is None else seen
    for ins in module.computations[name].instrs:
        yield ins.opcode
        for c in ins.called:
            if c in module.computations and c not in seen:
                seen.add(c)
                yield from _opcodes(module, c, seen)


def test_branch_computations_follow_switch_index():
    """XLA keeps lax.switch's order: branch_computations[i] is branch i (the analysis reads the
    plan's branch i as the conditional's i-th computation)."""
    fns = [jnp.sin, jnp.cos, jnp.exp, jnp.tanh]

    def f(i, x):
        return jax.lax.switch(i, [lambda x, g=g: g(x) for g in fns], x)

    text = jax.jit(f).lower(jnp.int32(0), jnp.ones(8)).compile().as_text()
    module = hlo.parse_module(text)
    switches = [i for c in module.computations.values() for i in c.instrs
                if i.opcode == "conditional"]
    assert len(switches) == 1 and len(switches[0].called) == 4
    for op, branch in zip(UNARY, switches[0].called, strict=True):
        ops = set(_opcodes(module, branch))
        assert op in ops and not (set(UNARY) - {op}) & ops, (op, branch, ops)


def _program(schedule: str, m: int, ticks: int = 1, cfg=CFG, fused: bool = False,
             split_head: bool = False):
    pipe = PipelineConfig(schedule=schedule, backward_ticks=ticks, fused_ticks=fused,
                          split_head=split_head)
    spec = CompileSpec(model=cfg, parallel=ParallelConfig(mesh=MESH, rules="tp",
                                                          schedule="megatron", pipeline=pipe),
                       batch_size=4 * m, seq_len=16, microbatches=m)
    mesh = make_mesh(MESH, jax.devices()[:4])
    compiled = lower(spec, mesh).compile()
    plan = executor.plan(pipeline_registry.get(schedule).build(2, m), ticks, fuse=fused,
                         head=split_head)
    return Program(compiled.as_text(), (("data", 2), ("stage", 2))), plan


@pytest.fixture(scope="module")
def gpipe():
    return _program("gpipe", 2)


@pytest.fixture(scope="module")
def one_f_one_b():
    return _program("1f1b", 4)


@pytest.fixture(scope="module")
def one_f_one_b_fused():
    return _program("1f1b", 4, fused=True)


@pytest.fixture(scope="module")
def merak_fused():
    return _program("merak", 3, fused=True)


@pytest.fixture(scope="module")
def one_f_one_b_split():
    return _program("1f1b", 4, ticks=2, cfg=CFG.replace(n_layers=4))


def _timed(program, plan, by_branch, rest=0.0, outside=0.0, permute=0.0, head=0.0):
    """pipeline_time with hand costs: each branch computation `by_branch[(kind, j)]`, the tick
    body's own ops `rest`, the entry's `outside`, a split head's phase `head`, each collective
    `permute` (charged on the first instruction of each computation, nothing elsewhere)."""
    loop = find_tick_loop(program, plan)
    per_comp = {c: by_branch.get(kb, 0.0) for kb, c in zip(plan.branches, loop.branches,
                                                            strict=True)}
    per_comp.update({h.called[0]: head for h in loop.heads})
    per_comp[loop.body] = rest
    per_comp[program.module.entry] = outside

    def compute(comp, instr):
        return per_comp.get(comp.name, 0.0) if instr is comp.instrs[0] else 0.0

    return pipeline_time(program, get_cluster("h100:8"), plan, compute_cost=compute,
                         comm_cost=lambda comp, idx, instr, kind: permute)


def test_finds_the_tick_loop_and_its_branches(gpipe):
    program, plan = gpipe
    loop = find_tick_loop(program, plan)
    assert loop is not None and program.module.trip_count(loop.loop) == len(plan.rows) == 6
    flops = {kb: program.flops_of(c) for kb, c in zip(plan.branches, loop.branches, strict=True)}
    assert flops[("IDLE", -1)] == 0
    for j in range(2):  # a backward does more arithmetic than its forward
        assert flops[("B", j)] > flops[("F", j)] > 0


def test_gpipe_against_hand_arithmetic(gpipe):
    """GPipe S=2, M=2: ticks F0 | F0 F1 | F1 | B1 | B0 B1 | B0 with F0=1, F1=3, B1=4, B0=2 take
    1+3+3+4+4+2 = 17, plus 0.25 of tick body each and 10 outside the loop."""
    program, plan = gpipe
    costs = {("F", 0): 1.0, ("F", 1): 3.0, ("B", 1): 4.0, ("B", 0): 2.0}
    pt = _timed(program, plan, costs, rest=0.25, outside=10.0)
    assert pt.switch_s == 17 and pt.loop_s == 17 + 6 * 0.25 and pt.outside.step_s == 10
    r = pt.to_json()
    assert r["step_s"] == 28.5
    assert r["busy_s"] == [6.0, 14.0]
    assert r["idle_fraction"] == pytest.approx([11 / 17, 3 / 17])
    assert r["bubble"] == pytest.approx(3 / 17)
    # The event model's lockstep step from per-stage F/B agrees with the plan-row arithmetic.
    assert r["events"]["lockstep_s"] == 17
    c = pt.stage_costs()
    assert (c.f, c.b) == ([1.0, 3.0], [2.0, 4.0])


def test_gpipe_idle_is_the_bubble_formula(gpipe):
    """Equal F and B: every stage idles (S-1)/(M+S-1) = 1/3 of the switch time, in the lockstep
    analysis and in the event simulator alike."""
    program, plan = gpipe
    pt = _timed(program, plan, {("F", 0): 1.0, ("F", 1): 1.0, ("B", 0): 1.0, ("B", 1): 1.0})
    r = pt.to_json()
    assert r["idle_fraction"] == pytest.approx([1 / 3, 1 / 3])
    assert r["events"]["idle_fraction"] == pytest.approx([1 / 3, 1 / 3])
    assert r["switch_s"] == r["events"]["makespan_s"] == r["events"]["lockstep_s"] == 6


def test_permutes_are_exposed_every_tick(gpipe):
    """CPU permutes are synchronous: the two per tick (activation, gradient) cost 2 x 0.5 each
    of the 6 ticks, none of it hidden."""
    program, plan = gpipe
    pt = _timed(program, plan, {("F", 0): 1.0, ("F", 1): 1.0, ("B", 0): 1.0, ("B", 1): 1.0},
                permute=0.5)
    r = pt.to_json()
    assert r["permute_s"] == r["exposed_comm_s"] == 6.0
    assert r["loop_s"] == 6 * (1 + 1.0)


def test_one_f_one_b_lockstep_exceeds_the_event_step(one_f_one_b):
    """1F1B S=2, M=4 with F=1, B=2: the event simulator's (M+S-1)(F+B) = 15, while lockstep
    ticks that pair an F with a B last max(F, B) = 2, and the plan-row arithmetic equals
    `lockstep_makespan`."""
    program, plan = one_f_one_b
    pt = _timed(program, plan, {("F", 0): 1.0, ("F", 1): 1.0, ("B", 0): 2.0, ("B", 1): 2.0})
    r = pt.to_json()
    table = plan.schedule.ticks()
    hand = sum(max((2 if a.kind == "B" else 1) for a in row if a.kind != "IDLE")
               for row in table.ticks)
    assert r["switch_s"] == r["events"]["lockstep_s"] == hand
    assert r["events"]["makespan_s"] == 15 < hand
    timeline = events.simulate(plan.schedule, events.Costs(f=1, b=2))
    assert timeline.makespan == Fraction(15)
    assert r["busy_s"] == [12.0, 12.0]
    assert r["idle_fraction"] == pytest.approx([1 - 12 / hand] * 2)


def test_fused_ticks_meet_the_event_step(one_f_one_b_fused):
    """The same 1F1B on its fused tick table (F0 | F1, F0+B0 | B0+F2, F1+B1 | B1+F3, F2+B2 |
    B2, F3+B3 | B3): the tick loop holds two switches (a stage's first and second action), a tick
    lasts as long as its slowest stage's lanes together, and with F=1, B=2 the compiled
    program's switch time is the event simulator's (M+S-1)(F+B) = 15, each stage idling as the
    event model says (3 of 15)."""
    program, plan = one_f_one_b_fused
    assert plan.lanes == 2 and plan.n_ticks == 6 and len(plan.rows) == 12
    loop = find_tick_loop(program, plan)
    assert len(loop.switches) == 2 and program.module.trip_count(loop.loop) == 6
    pt = _timed(program, plan, {("F", 0): 1.0, ("F", 1): 1.0, ("B", 0): 2.0, ("B", 1): 2.0})
    r = pt.to_json()
    assert r["switch_s"] == r["events"]["lockstep_s"] == r["events"]["makespan_s"] == 15
    assert r["idle_fraction"] == pytest.approx(r["events"]["idle_fraction"])
    assert r["idle_fraction"] == pytest.approx([3 / 15, 3 / 15])
    assert pt.per_tick.tolist() == [[1, 0], [1, 3], [3, 3], [3, 3], [2, 3], [2, 0]]


def test_split_head_phase_after_the_ticks_that_run_it():
    """1F1B with the head split over the stages (`--split-head on`, unfused): the tick body
    holds one more conditional, the head's phase (true: the phase, false: nothing), which runs
    after each tick where the last stage ran a forward; with F=1, B=2 and a phase of 0.5 the
    loop is the switch time plus M phases."""
    program, plan = _program("1f1b", 4, split_head=True)
    loop = find_tick_loop(program, plan)
    assert plan.head and plan.heads == 1 and len(loop.heads) == 1
    assert len(loop.heads[0].called) == 2 and loop.heads[0] not in loop.switches
    pt = _timed(program, plan, {("F", 0): 1.0, ("F", 1): 1.0, ("B", 0): 2.0, ("B", 1): 2.0},
                head=0.5)
    last_forward = [int(rows[0][1].kind == "F") for rows in plan.table.tick_rows()]
    assert pt.head_ticks.tolist() == last_forward and sum(last_forward) == 4
    r = pt.to_json()
    assert (r["head_phases"], r["head_phase_s"]) == (4, 0.5)
    assert r["loop_s"] == pytest.approx(r["switch_s"] + 4 * 0.5)


def test_merak_fused_two_sends_and_per_stage_recompute(merak_fused):
    """Merak's schedule, S=2, M=3, fused (PF0 | PF1+F2+RrG0, F0+B0 | B0+RrG1, F1+B1 | ...):
    three switches a tick, and one tick sends two activations, so the tick body's activation
    permute carries two. With hand costs FS0=1, F1=3, R0=5, B0=2, B1=4 the stage costs give
    each stage its own recompute (stage 0's R branch; the last stage, which never recomputes,
    F's), and the compiled switch time is the event model's lockstep step."""
    program, plan = merak_fused
    assert plan.lanes == 3 and plan.table.sends == 2
    loop = find_tick_loop(program, plan)
    assert len(loop.switches) == 3
    two = re.compile(r"\[2,\d+,16,64\]")  # [K=2, rows, seq 16, width 64]
    permutes = [i for c in program.module.computations.values() for i in c.instrs
                if i.opcode.startswith("collective-permute") and two.search(i.type_text)]
    assert permutes, "no permute of two activations"
    costs = {("FS", 0): 1.0, ("F", 1): 3.0, ("R", 0): 5.0, ("B", 0): 2.0, ("B", 1): 4.0}
    pt = _timed(program, plan, costs)
    c = pt.stage_costs()
    assert (c.f, c.r, c.b) == ([1.0, 3.0], [5.0, 3.0], [2.0, 4.0])
    r = pt.to_json()
    assert r["switch_s"] == r["events"]["lockstep_s"]
    timeline = events.simulate(plan.schedule, c)
    assert r["events"]["makespan_s"] == float(timeline.makespan)


def test_split_backward_ticks_meet_the_event_step(one_f_one_b_split):
    """The same 1F1B with each backward over two ticks (branches B0, B1: half a backward
    each, 1 of B=2): every tick holds one unit, so the compiled program's switch time is the
    event simulator's (M+S-1)(F+B) = 15 and each stage idles as the event model says."""
    program, plan = one_f_one_b_split
    assert {k for k, _ in plan.branches} == {"IDLE", "F", "B0", "B1"}
    costs = {(k, j): 1.0 for k, j in plan.branches if k != "IDLE"}
    r = _timed(program, plan, costs).to_json()
    assert r["switch_s"] == r["events"]["lockstep_s"] == r["events"]["makespan_s"] == 15
    assert r["idle_fraction"] == pytest.approx(r["events"]["idle_fraction"])
    c = _timed(program, plan, costs).stage_costs()
    assert (c.f, c.b) == ([1.0, 1.0], [2.0, 2.0])  # the backward is its parts' sum


def test_inspection_reports_the_pipeline():
    """`inspect_program` of a pipelined step carries the tick-loop time (outside + ticks, each
    tick its slowest branch plus the rest of the body) and its summary lines."""
    from oases_jax.targets import get_target
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.tools.report import summary

    pipe = PipelineConfig(schedule="gpipe", backward_ticks=1)
    spec = CompileSpec(model=CFG, parallel=ParallelConfig(mesh="data=4,stage=2", rules="tp",
                                                          schedule="megatron", pipeline=pipe),
                       batch_size=8, seq_len=16, microbatches=2)
    r = inspect_program(spec, get_target("local")).report()
    p = r["pipeline"]
    assert p["ticks"] == 6 and [b["kind"] for b in p["branches"]] == ["IDLE", "F", "F", "B", "B"]
    assert p["step_s"] == pytest.approx(p["outside_s"] + p["loop_s"])
    assert p["loop_s"] == pytest.approx(p["switch_s"] + 6 * p["rest_s"])
    assert 0 < p["bubble"] <= max(p["idle_fraction"]) < 1
    text = summary(r)
    assert "pipeline gpipe S=2 M=2, 6 ticks" in text and "event model" in text
