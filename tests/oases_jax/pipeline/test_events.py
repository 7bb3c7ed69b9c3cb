"""The event simulator against formulas and hand-worked timelines."""

import functools
from fractions import Fraction

import pytest

from oases_jax.errors import UserError
from oases_jax.pipeline import registry as pipeline_registry
from oases_jax.pipeline import schedules
from oases_jax.pipeline.events import Costs, lockstep_makespan, simulate


def _table(name, S, M, v):
    """The schedule's table, with v chunks per stage where it holds chunks."""
    spec = pipeline_registry.get(name)
    return spec.build(S, M, chunks=v if spec.chunked else 1)

COSTS = [(1, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("S", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 3, 7])
@pytest.mark.parametrize("f,b", COSTS)
def test_gpipe_and_1f1b_bubble_is_exact(S, extra, f, b):
    M = S + extra
    for sch in (schedules.gpipe(S, M), schedules.one_f_one_b(S, M)):
        t = simulate(sch, Costs(f=f, b=b))
        assert t.makespan == (M + S - 1) * (f + b)
        assert t.bubble == Fraction(S - 1, M + S - 1)
        assert t.busy == (M * (f + b),) * S


@pytest.mark.parametrize("S", [2, 3, 4, 8])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("f,b", COSTS)
def test_interleaved_bubble_is_exact(S, groups, v, f, b):
    M = S * groups
    t = simulate(schedules.interleaved(S, M, chunks=v), Costs(f=f, b=b))
    assert t.bubble == Fraction(S - 1, v * M + S - 1)
    assert t.makespan == Fraction((v * M + S - 1) * (f + b), v)


@pytest.mark.parametrize("S", [1, 2, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
@pytest.mark.parametrize("f,b,w", [(1, 2, 1), (1, 3, 1), (2, 3, 1), (1, 2, 0)])
def test_zb_h1_bubble_is_the_papers(S, extra, f, b, w):
    """ZB-H1 idles (S-1)(F+B-2W) per stage (B the whole backward), 1F1B (S-1)(F+B)."""
    M = S + extra
    t = simulate(schedules.zb_h1(S, M), Costs(f=f, b=b, w=w))
    assert t.makespan == M * (f + b) + (S - 1) * (f + b - 2 * w)
    assert t.idle == ((S - 1) * (f + b - 2 * w),) * S


UNIT = Costs(f=1, b=2, r=1)
# Merak S=4, M=8 under F=1, B=2, R=1, worked by hand (start times). Stage 3 never recomputes: each
# F waits for stage 2's forward, each B follows at once. Stage 2 runs PF0 PF1 F2 back to back,
# recomputes mb 0 (RrG0 at 5) before its gradient comes (6), and mb 1 between B0 and B1; from F3 it
# recomputes after each gradient (R at 12, 16, ...). Stages 1 and 0 hoist their last micro-batches'
# recompute (RrG) into the gaps left waiting for gradients: stage 0's RrG5 at 29 runs while stage 1
# computes B5 (28-30), so its B5 starts the moment the gradient lands.
MERAK_HAND = {
    3: "F0@3 B0@4 F1@6 B1@7 F2@9 B2@10 F3@12 B3@13 F4@16 B4@17 F5@20 B5@21 F6@24 B6@25 F7@28 B7@29",
    2: "PF0@2 PF1@3 F2@4 RrG0@5 B0@6 RrG1@8 B1@9 F3@11 R2@12 B2@13 F4@15 R3@16 B3@17 F5@19 R4@20 "
       "B4@21 F6@23 R5@24 B5@25 F7@27 R6@28 B6@29 R7@31 B7@32",
    1: "PF0@1 F1@2 F2@3 RrG0@4 B0@8 F3@10 R1@11 B1@12 F4@14 R2@15 B2@16 F5@18 R3@19 B3@20 PF6@22 "
       "R4@23 B4@24 PF7@26 R5@27 B5@28 RrG6@30 B6@31 RrG7@33 B7@34",
    0: "F0@0 F1@1 F2@2 F3@3 R0@10 B0@11 F4@13 R1@14 B1@15 PF5@17 R2@18 B2@19 PF6@21 R3@22 B3@23 "
       "PF7@25 R4@26 B4@27 RrG5@29 B5@30 RrG6@32 B6@33 RrG7@35 B7@36",
}


def starts(timeline, stage):
    return " ".join(f"{a.label()}@{t}" for a, t, _ in timeline.spans[stage])


@pytest.mark.parametrize("stage", range(4))
def test_merak_timeline_by_hand(stage):
    assert starts(simulate(schedules.merak(4, 8), UNIT), stage) == MERAK_HAND[stage]


def test_merak_beats_full_recompute_1f1b_by_more_than_ten_percent():
    """S=4, M=8, F=1, B=2, R=1. By hand: 1F1B with full recompute is 1F1B with a 3-unit backward
    (R then B), so (M+S-1)(F+R+B) = 11 * 4 = 44; sparing the last stage its recompute gives 42;
    Merak's table above ends with stage 0's B7 at 36 + 2 = 38 (= 0.864 * 44). The notes' larger
    case, S=8, M=16: 92 against 82."""
    makespan = {
        "1f1b full recompute": simulate(schedules.one_f_one_b(4, 8, recompute=True), UNIT),
        "1f1b, last stage no recompute": simulate(
            schedules.one_f_one_b(4, 8, recompute=(True, True, True, False)), UNIT),
        "merak": simulate(schedules.merak(4, 8), UNIT),
    }
    assert {k: t.makespan for k, t in makespan.items()} == {
        "1f1b full recompute": 44, "1f1b, last stage no recompute": 42, "merak": 38}
    assert makespan["merak"].makespan <= Fraction(9, 10) * makespan["1f1b full recompute"].makespan
    assert simulate(schedules.one_f_one_b(8, 16, recompute=True), UNIT).makespan == 92
    assert simulate(schedules.merak(8, 16), UNIT).makespan == 82
    # Same work, less waiting: every stage but the last recomputes all 8 micro-batches either way.
    assert makespan["merak"].recompute == (8, 8, 8, 0)
    assert makespan["1f1b full recompute"].recompute == (8, 8, 8, 8)


def test_transfer_time_by_hand():
    """GPipe S=2, M=1, F=1, B=2, p2p=1/2: F0 [0, 1) on stage 0, [1.5, 2.5) on stage 1, B0
    [2.5, 4.5) on stage 1, [5, 7) on stage 0."""
    t = simulate(schedules.gpipe(2, 1), Costs(f=1, b=2, p2p=Fraction(1, 2)))
    assert [(a.label(), s, f) for a, s, f in t.spans[1]] == [
        ("F0", Fraction(3, 2), Fraction(5, 2)), ("B0", Fraction(5, 2), Fraction(9, 2))]
    assert t.makespan == 7 and t.start(0, "B0") == 5


def test_per_stage_costs():
    """A slow last stage (F=2, B=4) in GPipe S=2, M=2: forwards end at 1+2+2 = 5, backwards take
    4+4 on stage 1 then stage 0's second B (2) after stage 1's last: 5 + 8 + 2 = 15."""
    t = simulate(schedules.gpipe(2, 2), Costs(f=(1, 2), b=(2, 4)))
    assert t.makespan == 15
    assert t.busy == (6, 12)


def test_lockstep_tick_program_by_hand():
    """1F1B S=2, M=2, F=1, B=2 run tick by tick (ticks F0/., F1/F0, ./B0, B0/F1, ./B1, B1/.):
    1 + 1 + 2 + 2 + 2 + 2 = 10, against 9 when each stage runs ahead on its own."""
    sch = schedules.one_f_one_b(2, 2)
    assert lockstep_makespan(sch.ticks(), Costs(f=1, b=2)) == 10
    assert simulate(sch, Costs(f=1, b=2)).makespan == 9
    assert lockstep_makespan(sch.ticks(), Costs(f=1, b=2, p2p=1)) == 10 + 4  # 4 ticks send


def test_in_flight_and_recompute_share():
    t = simulate(schedules.one_f_one_b(4, 8, recompute=True), UNIT)
    assert t.peak_inflight == (4, 3, 2, 1)
    assert t.recompute_share == Fraction(4 * 8, 4 * 44)


def test_bad_costs_are_one_line():
    for costs, text in [(Costs(f=-1), "cost f=-1"), (Costs(b=(1, 2)), "2 values for S=4"),
                        (Costs(w=3), "w=3 exceeds"), (Costs(p2p=-1), "p2p=-1")]:
        with pytest.raises(UserError, match=text) as e:
            simulate(schedules.one_f_one_b(4, 4), costs)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,S,M", [("gpipe", 4, 5), ("1f1b", 4, 8), ("1f1b", 2, 3),
                                      ("merak", 4, 8), ("merak", 3, 7), ("interleaved", 2, 4)])
@pytest.mark.parametrize("k", [2, 3])
def test_split_backward_ticks_are_the_event_model(name, S, M, k):
    """A backward spread over k ticks (each one k-th of it) makes the lockstep tick table the
    event model's placement with B = k forwards: the same makespan, each stage busy and idle on
    the same ticks. With whole-backward ticks (k=1) the lockstep step is longer."""
    sch = pipeline_registry.get(name).build(S, M)
    costs = Costs(f=1, b=k)
    table = sch.ticks(k)
    timeline = simulate(sch, costs)
    v = sch.chunks  # the model's costs are per stage: one chunk's forward takes 1/v
    assert lockstep_makespan(table, costs) == timeline.makespan == Fraction(len(table.ticks), v)
    busy = tuple(sum(a.kind != "IDLE" for a in col) for col in zip(*table.ticks, strict=True))
    assert busy == tuple(b * v for b in timeline.busy)
    for s, spans in enumerate(timeline.spans):  # each action on the ticks the model gives it
        for a, start, finish in spans:
            ticks = [t for t in range(int(start * v), int(finish * v))
                     if table.ticks[t][s] == a]
            assert len(ticks) == (finish - start) * v
            assert [table.part(t, s) for t in ticks] == list(range(len(ticks)))
    if name in ("1f1b", "merak"):
        assert lockstep_makespan(sch.ticks(), costs) > timeline.makespan


def test_split_backward_sends_after_its_last_part():
    table = schedules.one_f_one_b(2, 2).ticks(2)
    assert "B0a B0b" in table.pretty()
    last = {x: t for t, row in enumerate(table.transfers) for x in row if x.kind == "grad"}
    for x, t in last.items():
        assert table.ticks[t][1].kind == "B" and table.part(t, 1) == 1
        assert table.consumed[x] > t


def test_fused_tick_table_by_hand():
    """1F1B S=2, M=4 on fused ticks: the last stage runs F(m) and B(m) in one tick, stage 0
    B(m) then F(m+2) (its list's order, lane by lane). With F=1, B=2 the ticks take
    1, 3, 3, 3, 3, 2 = 15 = (M+S-1)(F+B), the event model's step, where one action a tick
    takes 18; and stage 0 holds 2 micro-batches' residuals at once, as its list does (B(m)
    frees its slot before F(m+2) takes one)."""
    from oases_jax.pipeline.validate import inflight

    sch = schedules.one_f_one_b(2, 4)
    table = sch.ticks(fuse=True)
    assert table.lanes == 2 and table.n_ticks == 6
    cells = [["+".join(r[s].label() for r in tick if r[s].kind != "IDLE") or "."
              for tick in table.tick_rows()] for s in range(2)]
    assert cells == [["F0", "F1", "B0+F2", "B1+F3", "B2", "B3"],
                     [".", "F0+B0", "F1+B1", "F2+B2", "F3+B3", "."]]
    costs = Costs(f=1, b=2)
    assert lockstep_makespan(table, costs) == simulate(sch, costs).makespan == 15
    assert lockstep_makespan(sch.ticks(), costs) == 18
    assert inflight(sch, table)[0] == (2, 1) and inflight(sch)[0] == (2, 1)
    # Transfers leave after a tick's last lane and are read in a later tick.
    L = table.lanes
    for t, moves in enumerate(table.transfers):
        assert not moves or t % L == L - 1
        for x in moves:
            assert table.consumed[x] // L > t // L
    assert "B0+F2" in table.pretty() and "fused ticks" in table.pretty()


@pytest.mark.parametrize("name,S,M,v", [("gpipe", 4, 5, 1), ("1f1b", 2, 3, 1), ("1f1b", 4, 8, 1),
                                        ("merak", 4, 8, 1), ("merak", 2, 5, 1),
                                        ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
                                        ("zb_h1", 4, 8, 1), ("1f1b", 8, 32, 1),
                                        ("merak", 8, 16, 1)])
def test_fused_tables_are_valid(name, S, M, v):
    """Every action once, on its own stage, in its list's order; a tick's run fills lanes
    0, 1, ... (no lane after an idle one), at most `fuse.lanes` of them, sending at most
    `sends` (1 or 2) activations and as many gradients; each transfer read after the tick that
    sends it (the validator's timing checks hold row by row)."""
    from oases_jax.pipeline import fuse
    from oases_jax.pipeline.validate import _timing

    sch = _table(name, S, M, v)
    table = sch.ticks(fuse=True)
    assert _timing(table) == []
    assert table.lanes <= fuse.lanes(sch.actions)
    for s, acts in enumerate(sch.actions):
        placed = [row[s] for row in table.ticks if row[s].kind != "IDLE"]
        assert placed == list(acts)
        for rows in table.tick_rows():
            run = [row[s] for row in rows]
            busy = [a.kind != "IDLE" for a in run]
            assert busy == sorted(busy, reverse=True)
            for kind in ("act", "grad"):
                assert sum(x.kind == kind for a in run for x in a.sends) <= table.sends <= 2


@pytest.mark.parametrize("name,S,M,v", [("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1), ("merak", 2, 5, 1),
                                        ("interleaved", 2, 4, 2), ("gpipe", 4, 5, 1),
                                        ("1f1b", 8, 32, 1)])
def test_fused_tables_with_a_split_head(name, S, M, v):
    """With a split head (`tick_table(head=True)`) the fused placement (A* to S=4, greedy at
    S=8) never runs the last virtual stage's forward and backward of one micro-batch in one
    tick (the head's phase runs between them, after the forward's tick); every other timing
    rule holds, and under A* the lockstep step is never below the table without that
    constraint."""
    from oases_jax.pipeline.validate import _timing

    sch = _table(name, S, M, v)
    table = sch.ticks(fuse=True, head=True)
    assert _timing(table) == []
    last = sch.virtual - 1
    for rows in table.tick_rows():
        done = {(a.kind, a.mb) for row in rows for a in [row[S - 1]]
                if a.kind != "IDLE" and a.chunk * S + S - 1 == last}
        assert not any(k in ("F", "PF") and ("B", mb) in done for k, mb in done), done
    if S <= 4:  # both placed by A*: the constrained optimum is no shorter
        assert lockstep_makespan(table) >= lockstep_makespan(sch.ticks(fuse=True))


def test_fused_placement_costs_are_the_unit_costs():
    """`fuse.UNIT` is `events.Costs()` per action, so the table the search picks is the one
    `fused_by_default` and the planner compare."""
    from oases_jax.pipeline import fuse
    from oases_jax.pipeline.events import durations

    for sch in (schedules.merak(2, 4), schedules.zb_h1(2, 4),
                schedules.interleaved(2, 4, chunks=2)):
        got = durations(sch, Costs())
        for acts in sch.actions:
            for a in acts:
                assert Fraction(fuse.UNIT[a.kind], sch.chunks) == got[a.kind][0]


def _exhaustive(sch, per_tick, sends):
    """The least sum over ticks of (the slowest stage's run + per_tick) at S=2, each stage
    sending at most `sends` activations and gradients a tick, trying every pair of runs from
    every state: the reference `fuse.cuts` is checked against."""
    from oases_jax.pipeline import fuse
    from oases_jax.pipeline.table import _order

    acts, cap = sch.actions, fuse.lanes(sch.actions)
    remote = {(s, i): [p for p, link in deps if link is not None]
              for s, i, _, deps in _order(sch)}
    n0, n1 = len(acts[0]), len(acts[1])

    def ends(s, i, other):
        out, sent = [i], []
        for k in range(i, min(len(acts[s]), i + cap)):
            sent += [x.kind for x in acts[s][k].sends]
            if any(q >= other for _, q in remote[(s, k)]) or max(
                    map(sent.count, sent), default=0) > sends:
                break
            out.append(k + 1)
        return out

    def work(s, i, k):
        return sum(Fraction(fuse.UNIT[a.kind], sch.chunks) for a in acts[s][i:k])

    @functools.cache
    def best(i0, i1):
        if (i0, i1) == (n0, n1):
            return Fraction(0)
        return min(max(work(0, i0, k0), work(1, i1, k1)) + per_tick + best(k0, k1)
                   for k0 in ends(0, i0, i1) for k1 in ends(1, i1, i0) if (k0, k1) != (i0, i1))

    return best(0, 0)


@pytest.mark.parametrize("name,M", [("merak", 2), ("merak", 5), ("merak", 8), ("1f1b", 3),
                                    ("1f1b", 8), ("gpipe", 4), ("interleaved", 4)])
def test_fused_placement_is_optimal(name, M):
    """At S=2 the fused table's lockstep step plus its ticks' own cost (and a second permute
    slot's, where it sends two) is the least any placement of the lists achieves
    (exhaustively, with one or two sends a tick), and Merak's at M=8 is the event model's 32
    units in 10 ticks, two activations sent in one, where the unfused table takes 33 in 24."""
    from oases_jax.pipeline import fuse

    sch = _table(name, 2, M, 2)
    table = sch.ticks(fuse=True)
    per_tick = fuse.PER_TICK + fuse.PER_SEND * (table.sends - 1)
    got = lockstep_makespan(table) + per_tick * table.n_ticks
    assert got == min(_exhaustive(sch, fuse.PER_TICK, 1),
                      _exhaustive(sch, fuse.PER_TICK + fuse.PER_SEND, 2))
    if (name, M) == ("merak", 8):
        assert lockstep_makespan(table) == simulate(sch).makespan == 32
        assert (table.n_ticks, table.sends, lockstep_makespan(sch.ticks())) == (10, 2, 33)


@pytest.mark.parametrize("S,M", [(2, 2), (2, 3), (2, 5), (2, 8), (3, 3), (3, 5), (3, 8)])
@pytest.mark.parametrize("f,b", COSTS)
def test_fused_1f1b_at_two_stages_is_the_event_model(S, M, f, b):
    """At S=2 every steady fused tick is F + B on both stages: the lockstep step is the event
    model's (M+S-1)(F+B) exactly; at S=3 it is no longer once M > S (a message waits a whole
    tick)."""
    sch = schedules.one_f_one_b(S, M)
    costs = Costs(f=f, b=b)
    got = lockstep_makespan(sch.ticks(fuse=True), costs)
    assert (got == (M + S - 1) * (f + b)) == (S == 2 or M == S), got


def test_fused_by_default_where_it_is_faster():
    from oases_jax.pipeline.events import fused_by_default

    assert fused_by_default(schedules.one_f_one_b(2, 8))
    assert fused_by_default(schedules.one_f_one_b(4, 8))  # 39 against 40 units
    assert fused_by_default(schedules.interleaved(2, 8, chunks=2))
    assert fused_by_default(schedules.interleaved(4, 8, chunks=2))
    assert fused_by_default(schedules.merak(2, 8))  # 32 against 33
    assert not fused_by_default(schedules.gpipe(2, 8))
    # From S=8 (`fuse.EXACT_STAGES`) the greedy placement is slower than one action a tick.
    assert not fused_by_default(schedules.one_f_one_b(8, 32))


def test_fused_table_refuses_a_split_backward():
    from oases_jax.pipeline.actions import InvalidSchedule

    with pytest.raises(InvalidSchedule, match="fused tick table runs each backward in one tick"):
        schedules.one_f_one_b(2, 4).ticks(2, fuse=True)
