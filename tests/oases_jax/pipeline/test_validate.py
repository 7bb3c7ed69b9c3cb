"""The validator rejects broken schedules with a message that names what is wrong."""

import dataclasses

import pytest

from oases_jax.pipeline import schedules
from oases_jax.pipeline.actions import Action, InvalidSchedule, wire
from oases_jax.pipeline.table import Schedule
from oases_jax.pipeline.validate import validate


def with_stage(sch: Schedule, stage: int, labels: str, rewire: bool = True) -> Schedule:
    """`sch` with stage `stage`'s list replaced by `labels` (e.g. "F0 B0 F1 B1")."""
    by_label = {a.label(): a for acts in sch.actions for a in acts}
    acts = [list(a) for a in sch.actions]
    acts[stage] = [by_label.get(t, Action(t.rstrip("0123456789"), int(t[-1])))
                   for t in labels.split()]
    return dataclasses.replace(sch, actions=wire(acts, sch.chunks) if rewire else tuple(
        map(tuple, acts)))


def rejected(sch: Schedule) -> str:
    with pytest.raises(InvalidSchedule) as e:
        validate(sch)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_swapped_actions_are_rejected():
    """Stage 1 of 1F1B (S=2, M=2) runs B0 before F0: a backward before its forward."""
    sch = with_stage(schedules.one_f_one_b(2, 2), 1, "B0 F0 F1 B1")
    msg = rejected(sch)
    assert "mb 0 on virtual stage 1 (stage 1) runs out of order on its stage (F@1 B@0)" in msg


def test_a_cycle_of_waits_is_a_deadlock():
    """Stage 0 runs B0 before F1 while stage 1 runs F1 before B0: each waits for the other."""
    sch = with_stage(schedules.one_f_one_b(2, 2), 0, "F0 B0 F1 B1")
    sch = with_stage(sch, 1, "F0 F1 B0 B1")
    msg = rejected(sch)
    assert "deadlocks" in msg
    assert "stage 0 at B0 waits for bwd of mb 0 on virtual stage 1" in msg
    assert "stage 1 at F1 waits for fwd of mb 1 on virtual stage 0" in msg


def test_missing_and_repeated_work_is_named():
    sch = schedules.gpipe(2, 2)
    assert "mb 1 on virtual stage 1 (stage 1) has 0 B, needs 1" in rejected(
        with_stage(sch, 1, "F0 F1 B0"))
    assert "has 2 forwards" in rejected(with_stage(sch, 0, "F0 F1 F1 B1 B0"))
    zb = schedules.zb_h1(2, 2)
    assert "has 0 W, needs 1" in rejected(with_stage(zb, 0, "F0 F1 B0 W0 B1"))


def test_recompute_pairing():
    """A PF needs an RrG; an R needs an F."""
    sch = schedules.merak(2, 2)  # stage 0: PF0 PF1 RrG0 B0 RrG1 B1
    assert "a PF needs an RrG" in rejected(with_stage(sch, 0, "PF0 PF1 B0 RrG1 B1"))
    assert "an R needs an F" in rejected(with_stage(sch, 0, "PF0 PF1 R0 B0 RrG1 B1"))


def test_transfers_must_match_the_kinds():
    sch = schedules.one_f_one_b(2, 2)
    bare = with_stage(sch, 1, "F0 B0 F1 B1", rewire=False)
    acts = [list(a) for a in bare.actions]
    acts[1][0] = acts[1][0].bare()  # stage 1's F0 forgets to receive its activation
    msg = rejected(dataclasses.replace(bare, actions=tuple(map(tuple, acts))))
    assert "stage 1 F0 carries recvs [] sends []" in msg
    assert "implies [act0 0->1]" in msg


def test_idle_and_out_of_range_entries_are_rejected():
    sch = schedules.one_f_one_b(2, 2)
    assert "lists hold work on micro-batches 0..1" in rejected(
        with_stage(sch, 0, "F0 F1 B0 B1 F5"))


def test_valid_schedule_reports_its_table():
    report = validate(schedules.one_f_one_b(4, 8))
    assert len(report.table.ticks) == 2 * (8 + 4 - 1)  # unit ticks: (M+S-1)(1+1)
