"""Pipeline schedules as data: every builder validates over a grid of S and M, the tables read as
written by hand, the in-flight counts follow each schedule's memory formula, and bad input is one
line naming the value and the fix."""

import pytest

from oases_jax.errors import UserError
from oases_jax.pipeline import registry as pipeline_registry
from oases_jax.pipeline import schedules
from oases_jax.pipeline.actions import CODES, Transfer
from oases_jax.pipeline.validate import validate

GRID = [(S, M) for S in (1, 2, 3, 4, 8) for M in (S, S + 1, 2 * S + 3)]


def order(schedule, stage):
    return " ".join(a.label(schedule.chunks) for a in schedule.actions[stage])


@pytest.mark.parametrize("S,M", GRID)
@pytest.mark.parametrize("name,options", [
    ("gpipe", {}), ("gpipe", {"recompute": True}), ("1f1b", {}), ("1f1b", {"recompute": True}),
    ("merak", {}), ("zb_h1", {}), ("interleaved", {"chunks": 2}), ("1f1b_spmd", {}),
    ("interleaved", {"chunks": 2, "recompute": True}),
])
def test_every_schedule_validates_over_the_grid(name, options, S, M):
    if name == "interleaved" and (S == 1 or M % S):
        with pytest.raises(UserError):
            pipeline_registry.get(name).build(S, M, **options)
        return
    sch = pipeline_registry.get(name).build(S, M, **options)
    report = validate(sch)
    forwards = sum(a.kind in ("F", "PF") for acts in sch.actions for a in acts)
    assert forwards == S * sch.chunks * M
    assert len(report.table.ticks) >= 2 * M * sch.chunks


@pytest.mark.parametrize("S,M", [(2, 4), (4, 4), (4, 8), (3, 6)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_validates_for_multiples_of_s(S, M, v):
    validate(schedules.interleaved(S, M, chunks=v))


def test_1f1b_table_reads_as_written():
    """S=2, M=3 by hand: stage 1 turns each forward around at once; stage 0 warms up with one
    forward and waits a tick for each gradient."""
    assert schedules.one_f_one_b(2, 3).pretty() == "\n".join([
        "1f1b: S=2 stages, M=3 micro-batches",
        "tick     0  1  2  3  4  5  6  7",
        "stage 0 F0 F1  . B0 F2 B1  . B2",
        "stage 1  . F0 B0 F1 B1 F2 B2  .",
    ])


def test_1f1b_spmd_table_and_in_flight():
    """1f1b_spmd by hand, S=2, M=3: in lockstep tick t stage s runs F(t-s) and B(t-(2S-2-s)),
    each tick's F before its B, so stage 1 turns each forward around in its own tick and stage
    0 runs three forwards before its first backward; every B recomputes its stage first.
    Stage s holds at most 2(S-1-s)+1 micro-batches (the executor's slots), one live set of
    activations."""
    sch = schedules.one_f_one_b_spmd(2, 3)
    assert order(sch, 0) == "F0 F1 F2 R0 B0 R1 B1 R2 B2"
    assert order(sch, 1) == "F0 R0 B0 F1 R1 B1 F2 R2 B2"
    for S, M in [(2, 3), (4, 8), (4, 3), (8, 16)]:
        r = validate(schedules.one_f_one_b_spmd(S, M))
        assert r.peak_inflight == tuple(min(2 * (S - 1 - s) + 1, M) for s in range(S))
        assert r.peak_live == (1,) * S


def test_interleaved_labels_carry_the_chunk():
    text = schedules.interleaved(2, 2, chunks=2).pretty()
    assert text.splitlines()[0] == (
        "interleaved: S=2 stages, M=2 micro-batches, v=2 chunks per stage")
    assert text.splitlines()[2].split()[2:6] == ["F0.0", "F1.0", "F0.1", "F1.1"]


MERAK_S4_M8 = {  # ../shared/PIPELINE_NOTES.md 1.4, Merak's generator: P = PF, R = RrG, B* = R B
    0: "F0 F1 F2 F3 B*0 F4 B*1 P5 B*2 P6 B*3 P7 B*4 R5 B5 R6 B6 R7 B7",
    1: "P0 F1 F2 R0 B0 F3 B*1 F4 B*2 F5 B*3 P6 B*4 P7 B*5 R6 B6 R7 B7",
    2: "P0 P1 F2 R0 B0 R1 B1 F3 B*2 F4 B*3 F5 B*4 F6 B*5 F7 B*6 B*7",
    3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
}


def notes_to_labels(text):
    out = []
    for tok in text.split():
        if tok.startswith("B*"):
            out += [f"R{tok[2:]}", f"B{tok[2:]}"]
        elif tok[0] == "P":
            out.append(f"PF{tok[1:]}")
        elif tok[0] == "R":
            out.append(f"RrG{tok[1:]}")
        else:
            out.append(tok)
    return " ".join(out)


@pytest.mark.parametrize("stage", range(4))
def test_merak_matches_merak_generator(stage):
    assert order(schedules.merak(4, 8), stage) == notes_to_labels(MERAK_S4_M8[stage])


def test_merak_last_stage_never_recomputes():
    for S, M in [(2, 2), (4, 5), (8, 19)]:
        sch = schedules.merak(S, M)
        assert {a.kind for a in sch.actions[-1]} == {"F", "B"}
        assert all(any(a.kind in ("R", "RrG") for a in acts) for acts in sch.actions[:-1])


@pytest.mark.parametrize("S,M", GRID)
def test_in_flight_micro_batches(S, M):
    """1F1B holds min(S-s, M) micro-batches on stage s, GPipe all M, ZB-H1 S everywhere (its
    deferred W keep s more on stage s), Merak one more than 1F1B on stage S-2; full recompute
    keeps one live set of activations."""
    r = validate(schedules.one_f_one_b(S, M))
    assert r.peak_inflight == tuple(min(S - s, M) for s in range(S)) == r.peak_live
    assert validate(schedules.gpipe(S, M)).peak_inflight == (M,) * S
    assert validate(schedules.one_f_one_b(S, M, recompute=True)).peak_live == (1,) * S
    assert validate(schedules.zb_h1(S, M)).peak_inflight == (S,) * S
    merak = validate(schedules.merak(S, M))
    assert merak.peak_live == (1,) * S
    want = [min(S - s, M) for s in range(S)]
    if S >= 2:
        want[S - 2] = min(3, M)  # stage S-2 runs its third forward before its first backward
    assert merak.peak_inflight == tuple(want)


@pytest.mark.parametrize("S,M,v", [(2, 2, 2), (4, 8, 2), (4, 4, 3), (8, 8, 2)])
def test_interleaved_in_flight_is_megatrons_warm_up(S, M, v):
    """Device s holds its 2(S-1-s) + (v-1)S warm-up chunks plus one (at most all v*M)."""
    want = tuple(min(2 * (S - 1 - s) + (v - 1) * S + 1, v * M) for s in range(S))
    assert validate(schedules.interleaved(S, M, chunks=v)).peak_inflight == want


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "merak", "zb_h1", "1f1b_spmd"])
def test_non_circular_schedules_have_no_wrap_around_edge(name):
    table = pipeline_registry.get(name).build(4, 8).ticks()
    assert not table.wraps()
    assert table.pairs("act") == {(0, 1), (1, 2), (2, 3)}
    assert table.pairs("grad") == {(1, 0), (2, 1), (3, 2)}


def test_interleaved_wraps_between_chunks():
    table = schedules.interleaved(4, 8, chunks=2).ticks()
    assert table.wraps()
    assert table.pairs("act") == {(0, 1), (1, 2), (2, 3), (3, 0)}
    assert table.pairs("grad") == {(1, 0), (2, 1), (3, 2), (0, 3)}


def test_tick_table_transfers_by_hand():
    """1F1B S=2, M=2 by hand (stage 0 / stage 1 per tick): 0 F0/., 1 F1/F0, 2 ./B0, 3 B0/F1,
    4 ./B1, 5 B1/.; each action's outputs move after its tick."""
    table = schedules.one_f_one_b(2, 2).ticks()
    assert [[a.label() for a in row] for row in table.ticks] == [
        ["F0", "."], ["F1", "F0"], [".", "B0"], ["B0", "F1"], [".", "B1"], ["B1", "."]]
    act, grad = Transfer("act", 0, 0, 1), Transfer("grad", 0, 1, 0)
    assert table.transfers == ((act,), (Transfer("act", 1, 0, 1),), (grad,), (), (
        Transfer("grad", 1, 1, 0),), ())
    assert table.consumed[act] == 1 and table.consumed[grad] == 3
    assert table.consumed[Transfer("act", 1, 0, 1)] == 3  # held two ticks: stage 1 ran B0
    assert table.held_peak("act") == (0, 1) and table.held_peak("grad") == (1, 0)
    assert table.codes()[2] == ((CODES["IDLE"], -1, 0), (CODES["B"], 0, 0))


def test_actions_carry_their_transfers():
    sch = schedules.one_f_one_b(3, 3, recompute=True)
    mid = {a.label(): a for a in sch.actions[1]}
    assert mid["F0"].recvs == (Transfer("act", 0, 0, 1),)
    assert mid["F0"].sends == (Transfer("act", 0, 1, 2),)
    assert mid["R0"].recvs == (Transfer("grad", 0, 2, 1),)  # R waits for the gradient
    assert mid["B0"].recvs == () and mid["B0"].sends == (Transfer("grad", 0, 1, 0),)
    hoisted = {a.label(): a for a in schedules.merak(4, 8).actions[0]}
    assert hoisted["RrG5"].recvs == () and hoisted["B5"].recvs == (Transfer("grad", 5, 1, 0),)


def one_line_error(fn, *args, **kwargs):
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_input_is_one_line_naming_value_and_fix():
    assert "'pipedream'" in one_line_error(pipeline_registry.get, "pipedream")
    names = "gpipe, gpipe_spmd, 1f1b, 1f1b_spmd, interleaved, merak, zb_h1"
    assert names in one_line_error(pipeline_registry.get, "x")
    for name in ("merak", "zb_h1", "interleaved"):
        msg = one_line_error(pipeline_registry.get(name).build, 4, 3)
        assert "M=3" in msg and "S=4" in msg and "M >= 4" in msg
    msg = one_line_error(schedules.interleaved, 4, 6, chunks=2)
    assert "M=6" in msg and "M = 4 or 8" in msg
    assert "v=1" in one_line_error(schedules.interleaved, 4, 8, chunks=1)
    assert "S=1" in one_line_error(schedules.interleaved, 1, 4, chunks=2)
    assert "M=0" in one_line_error(schedules.gpipe, 2, 0)
    assert "S=0" in one_line_error(schedules.one_f_one_b, 0, 2)
    assert "3 per-stage flags" in one_line_error(schedules.one_f_one_b, 4, 8,
                                                 recompute=(True, True, False))


def test_per_stage_recompute_flags():
    sch = schedules.one_f_one_b(3, 3, recompute=(True, True, False))
    assert [any(a.kind == "R" for a in acts) for acts in sch.actions] == [True, True, False]
