"""The planner against the schedule registry: its choices are the registry's planned schedules,
each has an entry in the planner's calibration tables and a cost model, and plans store layers
as `LayerSpec` JSON that loads back equal."""

import json

import pytest

from oases_jax import registry
from oases_jax.errors import UserError
from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.presets import get_preset
from oases_jax.planner import make_plan
from oases_jax.planner import plan as plans
from oases_jax.planner.cost import primepar_cost
from oases_jax.planner.cost.layer_cost import LayerModel, comm_pattern
from oases_jax.planner.cost.layer_work import SCHEDULE_PASSES
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.dense import REMATS, SCHEDULES
from oases_jax.remat import POLICIES

PLANNED = registry.names(planned=True)


def test_choices_are_the_registrys_planned_schedules():
    assert SCHEDULES == PLANNED and "xla_auto" not in SCHEDULES
    assert set(REMATS) <= set(POLICIES)


@pytest.mark.parametrize("schedule", PLANNED)
def test_every_planned_schedule_has_a_calibration_entry_and_a_cost_model(schedule):
    assert schedule in SCHEDULE_PASSES, f"SCHEDULE_PASSES lacks planned schedule {schedule!r}"
    if registry.get(schedule).square:  # priced on its own square layouts
        assert schedule == primepar_cost.SCHEDULE
        layout = Layout(tensor=4, global_batch=8, seq_len=128, primepar=True)
    else:
        layout = Layout(tensor=4, global_batch=8, seq_len=128)
    spec = LayerSpec(schedule=schedule, sub_batches=2 if registry.get(schedule).sub_batches else 1)
    cost = LayerModel(get_preset("small"), layout, Hardware.of(get_cluster("h100-8"))).time(spec)
    assert cost.step_s > 0 and cost.act_bytes > 0


def test_comm_patterns_follow_the_registry():
    assert {s: comm_pattern(s) for s in PLANNED if not registry.get(s).square} == {
        "megatron": "all_reduce", "megatron_sp": "gather_scatter", "collective_matmul": "ring",
        "oases": "deferred", "oases_cm": "ring"}
    assert comm_pattern("none") == "none"
    assert comm_pattern("oases_sp") == "seq_deferred"  # priced, not yet planned


def test_plan_layers_round_trip_through_json():
    cfg = get_preset("small")
    d, r = make_plan(cfg, model="small", cluster=get_cluster("3090-nvlink-32"), global_batch=64,
                     seq_len=128)
    p = plans.from_json(json.loads(json.dumps(d)))
    assert p.layers == r.best.strategies and all(isinstance(s, LayerSpec) for s in p.layers)
    assert [s.to_json() for s in p.layers] == d["layers"]
    assert all(list(e) == ["schedule", "sub_batches", "remat"] for e in d["layers"])


def test_plan_entries_written_before_layer_spec_still_load():
    d = {"mesh": {"data": 2, "tensor": 4}, "rules": "tp", "microbatches": 1, "global_batch": 8,
         "seq_len": 32, "layers": [{"schedule": "oases", "sub_batches": 2, "remat": "save_proj"},
                                   {"schedule": "megatron"}]}
    assert plans.from_json(d).layers == (
        LayerSpec(schedule="oases", sub_batches=2, remat="save_proj"), LayerSpec())
    d["layers"][1]["remat"] = "sometimes"
    with pytest.raises(UserError, match=r"layers\[1\].remat: unknown remat 'sometimes'") as e:
        plans.from_json(d)
    assert "\n" not in str(e.value)


def test_sub_batch_counts_are_the_ones_each_schedule_was_fitted_at():
    """oases_sp's passes were fitted at 2 sub-batches: the search offers it there only, while
    oases keeps 2 and 4."""
    from oases_jax.planner.search.dense import strategies

    got = strategies(Layout(data=2, tensor=4, global_batch=16, seq_len=128),
                     schedules=("oases", "oases_sp"), remats=("none",))
    assert {(s.schedule, s.sub_batches) for s in got} == {
        ("oases", 2), ("oases", 4), ("oases_sp", 2)}
