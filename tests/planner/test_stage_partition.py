"""The stage partitioner against brute force over every contiguous partition (L <= 10 layers,
S <= 4 stages), the exact event simulator, and hand-checked cases."""

import itertools
import math
import random
from fractions import Fraction

import pytest

from oases_jax.pipeline import events
from oases_jax.planner.cost.prices import SharedCores
from oases_jax.planner.cost.stage_sim import (
    backward_ticks,
    fused,
    peak_inflight,
    simulate_events,
    tick_choices,
)
from oases_jax.planner.search.stage_partition import (
    StageInputs,
    _Stages,
    bottleneck,
    build,
    fixed,
    partition,
    simulate,
)


def compositions(L: int, S: int):
    for cuts in itertools.combinations(range(1, L), S - 1):
        edges = (0, *cuts, L)
        yield tuple(b - a for a, b in itertools.pairwise(edges))


def brute(x, schedule, S, M, p2p=0.0, budget=math.inf):
    """(least simulated step, least bottleneck) over every partition that fits."""
    st = _Stages(x, schedule, S, M, 1, budget)
    best_step = best_load = math.inf
    for counts in compositions(x.n_layers, S):
        got = st.evaluate(counts)
        if got is None:
            continue
        f, b, r = ([g[k] for g in got] for k in range(3))
        best_step = min(best_step, simulate(schedule, M, 1, f, b, r, p2p)[0])
        best_load = min(best_load, max(g[0] + g[1] + g[2] for g in got))
    return best_step, best_load


def random_inputs(rng, L, memory=False):
    f = [rng.choice((1, 2, 3)) * 1.0 for _ in range(L)]
    act = [rng.choice((2, 3, 4)) * 1.0 for _ in range(L)] if memory else [0.0] * L
    return StageInputs(f=tuple(f), b=tuple(2 * v for v in f), r=tuple(f), act=tuple(act),
                       act_remat=tuple(a / 4 for a in act), temp=(0.0,) * L,
                       temp_remat=tuple(act), block_bytes=1.0 if memory else 0.0,
                       last_f=rng.choice((0.0, 2.0, 5.0)), last_b=rng.choice((0.0, 4.0)),
                       first_f=rng.choice((0.0, 1.0)))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "merak"])
def test_matches_brute_force(schedule):
    rng = random.Random(17)
    for _ in range(12):
        L, S = rng.randint(4, 10), rng.randint(2, 4)
        M = rng.choice((S, 2 * S)) if schedule == "merak" else rng.randint(1, 2 * S)
        x = random_inputs(rng, L)
        p2p = rng.choice((0.0, 0.5))
        plan = partition(x, schedule=schedule, stages=S, microbatches=M, p2p=p2p,
                         max_leaves=2000, max_sims=5000)
        step, load = brute(x, schedule, S, M, p2p)
        assert plan.exact
        assert plan.makespan == pytest.approx(step), (L, S, M, plan.layers)
        assert sum(plan.layers) == L and len(plan.layers) == S
        st = _Stages(x, schedule, S, M, 1, math.inf)
        dp = min(bottleneck(st, lmax)[0] for lmax in range(-(-L // S), L - S + 2))
        assert dp == pytest.approx(load)


def test_matches_brute_force_under_memory():
    """With a budget, stages recompute their first layers until they fit; the partitioner's
    step and remat counts agree with brute force over partitions (each stage its least k)."""
    rng = random.Random(5)
    checked = 0
    for _ in range(20):
        L, S, M = rng.randint(4, 9), rng.randint(2, 4), rng.randint(2, 8)
        x = random_inputs(rng, L, memory=True)
        budget = rng.uniform(10, 30)
        plan = partition(x, schedule="1f1b", stages=S, microbatches=M, budget=budget)
        step, _ = brute(x, "1f1b", S, M, budget=budget)
        if plan is None:
            assert step == math.inf
            continue
        checked += 1
        assert plan.makespan == pytest.approx(step)
        assert max(plan.memory) <= budget * (1 + 1e-12)
    assert checked >= 8


def test_float_simulators_equal_exact():
    """The planner's step is the executor's tick table in lockstep (`events.lockstep_makespan`
    in exact fractions, fused ticks their lanes' sum) plus the permutes the executor issues
    every tick, and its run-ahead bound the event simulator's makespan; every schedule gets one
    tick per backward (the plan's choice, `tick_choices`) on the table the runtime's rule picks
    (`fused`: here all but GPipe's), and other spans and tables are priced on request. Outside
    Merak's schedule a stage recomputes inside its backward (no R actions): B is b + r there."""
    f, b, r = (3, 2, 2, 4), (6, 4, 4, 9), (0, 2, 0, 0)

    def sch_of(name, chunks, r):
        return build(name, 4, 8, chunks, tuple(x > 0 for x in r) if name == "merak"
                     else (False,) * 4)

    def costs_of(name):
        b_run = b if name == "merak" else tuple(map(sum, zip(b, r, strict=True)))
        return events.Costs(f=f, b=b_run, r=r, p2p=0)

    for name, chunks in (("1f1b", 1), ("gpipe", 1), ("merak", 1), ("interleaved", 2)):
        assert backward_ticks(name, 8, chunks, f, b, r, 1.0) == 1 == tick_choices(name, f, b,
                                                                                   r)[0]
        sch = sch_of(name, chunks, r)
        assert fused(name, 4, 8, chunks) == (name != "gpipe")
        for k, fuse in ((None, None), (1, None), (1, False), (1, True), (2, None)):
            got = simulate(name, 8, chunks, f, b, r, 1.0, k=k, fuse=fuse)[0]
            table = sch.ticks(k or 1, fused(name, 4, 8, chunks) and (k or 1) == 1
                              if fuse is None else fuse)
            # ... plus the executor's permutes, every tick: 2, or 4 with chunks.
            assert got == pytest.approx(float(events.lockstep_makespan(table, costs_of(name)))
                                        + table.n_ticks * (2 if chunks == 1 else 4))
        if name != "merak":  # the event model's own reading: R actions where r > 0
            sch = build(name, 4, 8, chunks, tuple(x > 0 for x in r))
        ahead = simulate_events(name, 8, chunks, f, b, r, 1.0)[0]
        assert ahead == float(events.simulate(sch, events.Costs(f=f, b=b, r=r, p2p=1)).makespan)
        assert ahead <= simulate(name, 8, chunks, f, b, r, 1.0)[0]


def test_uniform_costs_give_the_uniform_split():
    x = StageInputs.uniform(48, f=1.0, b=2.0)
    for S in (2, 4, 8):
        plan = partition(x, schedule="1f1b", stages=S, microbatches=2 * S)
        assert plan.layers == (48 // S,) * S
        # 1F1B run ahead: (M + S - 1) x (f + b) per layer-stack of 48 / S layers; in lockstep
        # with one tick per backward every tick that holds a B lasts a B
        f = (48 / S,) * S
        ahead = simulate_events("1f1b", 2 * S, 1, f, [2 * x for x in f], (0,) * S)[0]
        assert ahead == pytest.approx((2 * S + S - 1) * 3 * 48 / S)
        assert ahead <= plan.makespan


def test_heavy_head_moves_layers_to_earlier_stages():
    """16 layers of 1 + 2 and a head of 3 layers' cost on the last stage, 4 stages: the least
    bottleneck is 15 (57 / 4 = 14.25 rounded up to whole layers: 5 layers on each early stage),
    against 4 x 3 + 9 = 21 uniform. Of the splits attaining it, the fused tick table the
    runtime runs 1F1B at S=4, M=8 on (`fused`) takes 186 with (5,5,5,1) against 192 with
    (4,5,5,2) and 213 uniform; one action a tick they take 198 and 197 (stage 0's lighter
    ticks shorten the warm-up and cool-down, where it runs alone), uniform 211; with two
    ticks per backward 163 and 162."""
    x = StageInputs.uniform(16, f=1.0, b=2.0, last_f=3.0, last_b=6.0)
    plan = partition(x, schedule="1f1b", stages=4, microbatches=8)
    assert plan.layers[-1] < 4 and sum(plan.layers) == 16
    assert max(plan.loads) == pytest.approx(15.0)
    uniform = simulate("1f1b", 8, 1, (4, 4, 4, 7), (8, 8, 8, 14), (0,) * 4)[0]
    assert plan.makespan < uniform
    assert fused("1f1b", 4, 8)
    assert plan.layers == (5, 5, 5, 1) and plan.makespan == pytest.approx(186.0)
    assert plan.backward_ticks == 1 and uniform == 213.0
    assert simulate("1f1b", 8, 1, (4, 5, 5, 5), (8, 10, 10, 10), (0,) * 4)[0] == 192.0
    assert simulate("1f1b", 8, 1, (5, 5, 5, 4), (10, 10, 10, 8), (0,) * 4, fuse=False)[0] == 198
    assert simulate("1f1b", 8, 1, (4, 5, 5, 5), (8, 10, 10, 10), (0,) * 4, fuse=False)[0] == 197
    assert simulate("1f1b", 8, 1, (4, 4, 4, 7), (8, 8, 8, 14), (0,) * 4, fuse=False)[0] == 211
    assert simulate("1f1b", 8, 1, (4, 5, 5, 5), (8, 10, 10, 10), (0,) * 4, k=2)[0] == 162.0
    assert simulate("1f1b", 8, 1, (5, 5, 5, 4), (10, 10, 10, 8), (0,) * 4, k=2)[0] == 163.0


def test_interleaved_head_runs_on_the_last_chunk():
    """With v chunks per device the head runs on virtual stage vS-1 alone, not spread over the
    last device's chunks. Interleaved, S=2, M=2, v=2 (tick table in the comments), f=(4, 6),
    b=(8, 12), the head's 2 and 4 of stage 1's: its chunks run F 2 and 4, B 4 and 8; stage
    0's F 2, B 4. By hand, unfused tick by tick (the longest cell):
        0 F0.0: 2 | 1 F1.0 F0.0: 2 | 2 F0.1 F1.0: 2 | 3 F1.1 F0.1: 2, 4 -> 4 | 4 B0.1: 8
        5 B0.1 F1.1: 4, 4 | 6 B1.1: 8 | 7 B1.1 B0.0: 4, 4 | 8 B0.0 B1.0: 4 | 9 B1.0: 4
    = 42, stage 1 done at 38. Spread over both chunks (F 3, B 6 each) it is 43."""
    from oases_jax.planner.cost.stage_sim import chunk_costs

    assert chunk_costs((4.0, 6.0), 2, 1.0, 2.0) == ((2.5, 1.5), (2.0, 4.0))
    f, b, r = (4.0, 6.0), (8.0, 12.0), (0.0, 0.0)
    assert simulate("interleaved", 2, 2, f, b, r, k=1, ends=(0.0, 0.0, 2.0, 4.0),
                    fuse=False) == (42.0, (42.0, 38.0))
    assert simulate("interleaved", 2, 2, f, b, r, k=1, fuse=False)[0] == 43.0
    # One chunk per device: where the head sits inside the stage changes nothing.
    assert simulate("1f1b", 8, 1, (5, 5, 5, 4), (10, 10, 10, 8), (0,) * 4,
                    ends=(1.0, 2.0, 3.0, 6.0))[0] == 186.0
    ahead = simulate_events("interleaved", 2, 2, f, b, r, ends=(0.0, 0.0, 2.0, 4.0))[0]
    assert ahead <= 42.0


def test_memory_forces_recompute_on_early_stages():
    """1F1B's lists hold S - s micro-batches on stage s; at S=2 it runs its fused tick table
    (`stage_sim.fused`), which keeps each stage's list order (a tick's B frees its slot before
    the tick's next F takes one): 2 in flight on stage 0, as the lists. 8 layers keeping 2
    bytes each (0.5 when rematted), 1 byte of state per layer, a 12-byte budget, 2 stages of
    4: stage 0 needs 4 + 2 (0.5 k + 2 (4 - k)) = 20 - 3k <= 12, so k = 3 (k = 2: 14); stage 1
    (1 in flight) 4 + 8 = 12 fits without recompute."""
    x = StageInputs.uniform(8, f=1.0, b=2.0, r=1.0, act=2.0, act_remat=0.5, block_bytes=1.0)
    assert peak_inflight("1f1b", 2, 4) == (2, 1)
    plan = partition(x, schedule="1f1b", stages=2, microbatches=4, budget=12.0)
    assert plan.layers == (4, 4) and plan.remat == (3, 0)
    assert plan.ratios == (Fraction(3, 4), Fraction(0))
    assert plan.memory == (pytest.approx(4 + 2 * 3.5), pytest.approx(4 + 8))
    assert plan.r == (3.0, 0.0)


def test_merak_recomputes_every_stage_but_the_last_whole():
    """As the program runs Merak's schedule: a stage before the last keeps one input per held
    micro-batch and re-runs its whole forward in R (r = f, all its layers recomputed, whatever
    the budget needs), holding one micro-batch's residuals until its B; the last stage has no
    R and recomputes its rematted layers inside its backward. 8 layers of f=1, b=2, r=0.7, 2
    bytes kept (0.5 rematted), 1 byte of state each, 2 stages of 4, M=4, no budget: stage 0
    holds its peak in-flight micro-batches' inputs (0.5 each) + 4 x 2 of one micro-batch's
    residuals + 4 of state; stage 1 none recomputed, 1 x 8 + 4. With full remat asked of the
    last stage (`fixed`, remat 4) its backward runs 2 x 4 + 0.7 x 4."""
    x = StageInputs.uniform(8, f=1.0, b=2.0, r=0.7, act=2.0, act_remat=0.5, block_bytes=1.0)
    held = _Stages(x, "merak", 2, 4, 1, math.inf).held[0]
    plan = fixed(x, schedule="merak", counts=(4, 4), remat=(0, 0), microbatches=4)
    assert plan.remat == (4, 0) and plan.ratios == (Fraction(1), Fraction(0))
    assert plan.r == (4.0, 0.0) and plan.b == (8.0, 8.0)
    assert plan.memory == (pytest.approx(4 + held * 0.5 + 8), pytest.approx(4 + 8))
    full = fixed(x, schedule="merak", counts=(4, 4), remat=(4, 4), microbatches=4)
    assert full.r == (4.0, pytest.approx(2.8)) and full.remat == (4, 4)
    step = simulate("merak", 4, 1, full.f, full.b, full.r)[0]
    # The last stage's backward, 8 + 2.8, is what the lockstep ticks see: no R of its own.
    plain = simulate("merak", 4, 1, full.f, (8.0, 8.0), (4.0, 0.0))[0]
    assert step > plain


def test_interleaved_keeps_chunks_equal():
    x = StageInputs.uniform(16, f=1.0, b=2.0, last_f=1.0, last_b=2.0)
    plan = partition(x, schedule="interleaved", stages=4, microbatches=8, chunks=2)
    assert all(n % 2 == 0 for n in plan.layers) and sum(plan.layers) == 16
    assert not plan.exact


def test_nothing_fits():
    x = StageInputs.uniform(8, f=1.0, b=2.0, act=2.0, act_remat=1.0, block_bytes=1.0)
    assert partition(x, schedule="1f1b", stages=2, microbatches=4, budget=3.0) is None


def test_shared_cores_tick_is_processor_sharing():
    """8 devices on 2 cores in 2 groups of 4: the groups share the cores, so two groups' work a
    and b (each timed with all 8 busy) take a + (b - a) / 2, and one group alone half its time;
    one device alone gets one core, 4x the all-busy share."""
    host = SharedCores(devices=8, cores=2)
    assert host.tick([3.0, 5.0], 2) == pytest.approx(3.0 + (5.0 - 3.0) / 2)
    assert host.tick([4.0], 2) == pytest.approx(2.0)
    assert host.tick([4.0, 4.0], 2) == pytest.approx(4.0)
    assert host.tick([8.0], 8) == pytest.approx(2.0)
    assert host.tick([], 2) == 0.0
    # More cores than devices: nothing is shared, every device runs at its own speed.
    assert SharedCores(devices=2, cores=8).tick([3.0, 5.0], 2) == pytest.approx(5.0)


def test_shared_cores_price_the_bubble_by_the_work_left():
    """GPipe, S=2, M=4, F=1, B=2 on both stages: in lockstep 5 forward ticks of 1 and 5 backward
    ticks of 2 (15); with the 8 devices sharing 2 cores a tick with one stage busy takes half
    its work, so the step is the total work over the two groups, 4 x 3 x 2 / 2 = 12."""
    f, b, r = (1.0, 1.0), (2.0, 2.0), (0.0, 0.0)
    assert simulate("gpipe", 4, 1, f, b, r)[0] == pytest.approx(15.0)
    host = SharedCores(devices=8, cores=2)
    assert simulate("gpipe", 4, 1, f, b, r, shared=host)[0] == pytest.approx(12.0)
    # 1F1B's unfused mixed ticks (F on one stage, B on the other) cost their mean there, not
    # their max; its fused ticks (F and B on each stage in steady state) are GPipe's 15.
    assert simulate("1f1b", 4, 1, f, b, r, shared=host, fuse=False)[0] == pytest.approx(12.0)
    assert simulate("1f1b", 4, 1, f, b, r, fuse=False)[0] > 15.0
    assert simulate("1f1b", 4, 1, f, b, r)[0] == pytest.approx(15.0)
