"""Projection strategies: which one each schedule runs, with and without a split to overlap."""

import pytest

from oases_jax import projections as proj
from oases_jax import registry
from oases_jax.mesh import make_mesh
from oases_jax.rules import get_rules

EXPECTED = {  # (outside a layer-wide shard_map, inside one) on a tensor=4 mesh
    "megatron": (proj.Gspmd, None),
    "megatron_sp": (proj.PerProjection, None),
    "collective_matmul": (proj.PerProjection, None),
    "oases": (proj.Gspmd, proj.LocalAllReduce),
    "oases_cm": (proj.PerProjection, proj.LocalRing),
    "xla_auto": (proj.GspmdPinned, None),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_schedule_gets_its_strategy(name):
    spec = registry.get(name)
    mesh = make_mesh("data=2,tensor=4")
    rules = get_rules(spec.rules_for("tp"))
    outside, inside = EXPECTED[name]
    got = proj.strategy_for(spec, rules, mesh)
    assert type(got) is outside
    if isinstance(got, proj.PerProjection):
        local = {"seq_parallel": proj.LocalSeq, "ring": proj.LocalRing}[spec.projection]
        assert type(got.local) is local
        assert got.gathers_in_column
    if inside is not None:
        assert type(proj.strategy_for(spec, rules, mesh, manual=True)) is inside
    # Without a tensor split there is nothing to communicate: plain einsums.
    flat = proj.strategy_for(spec, rules, make_mesh("data=8"))
    assert type(flat) is (proj.GspmdPinned if name == "xla_auto" else proj.Gspmd)


def test_primepar_on_a_square():
    spec = registry.get("primepar")
    mesh = make_mesh("data=2,tp_row=2,tp_col=2")
    got = proj.strategy_for(spec, get_rules("primepar"), mesh)
    assert type(got) is proj.PrimePar and got.gathers_in_column


def test_the_active_strategy_is_scoped():
    assert type(proj.active()) is proj.Gspmd
    with proj.use(proj.LocalAllReduce("tensor")) as p:
        assert proj.active() is p
    assert type(proj.active()) is proj.Gspmd
