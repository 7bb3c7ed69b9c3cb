"""`oases_jax.embedding.lookup`: the plain gather outside a manual region; inside one (a
pipeline's stage loop), the per-device vocabulary-parallel lookup, equal to `jnp.take` in value
and in the table's gradient, on rule sets that split the table over one axis or two."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.embedding import lookup
from oases_jax.mesh import make_mesh
from oases_jax.rules import get_rules, outer_axes, use_rules

V, D, B, L = 64, 16, 8, 6


def _inputs():
    table = jax.random.normal(jax.random.key(0), (V, D))
    ids = jax.random.randint(jax.random.key(1), (B, L), 0, V)
    ct = jax.random.normal(jax.random.key(2), (B, L, D))
    return table, ids, ct


def _reference(table, ids, ct):
    def f(t):
        return jnp.sum(jnp.take(t, ids, axis=0) * ct)
    return jnp.take(table, ids, axis=0), jax.grad(f)(table)


@pytest.mark.parametrize(("mesh_text", "rules", "manual"), [
    ("stage=2,tp_row=2,tp_col=2", "primepar", ("stage",)),  # vocab over tp_col, embed over tp_row
    ("data=2,stage=2,tensor=2", "fsdp_tp", ("stage",)),  # vocab over tensor, embed over data
    ("stage=2,tensor=4", "tp", ("stage",)),
    ("data=2,tensor=4", "tp", ()),  # no manual region: the plain gather
])
def test_lookup_equals_take(mesh_text, rules, manual):
    mesh, rules = make_mesh(mesh_text, jax.devices()), get_rules(rules)
    table, ids, ct = _inputs()
    want, want_grad = _reference(table, ids, ct)
    table = jax.device_put(table, NamedSharding(mesh, rules.param_spec(("vocab", "embed"), mesh)))

    def body(t, i, c):
        def f(t):
            with outer_axes(*manual), use_rules(rules, mesh):
                x = lookup(t, i)
            return jnp.sum(x * c), x
        (_, x), g = jax.value_and_grad(f, has_aux=True)(t)
        if manual:
            g = jax.lax.pmean(g, manual)  # every stage computed the same gradient
        return x, g

    if manual:
        body = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                             axis_names=set(manual), check_vma=False)
    with jax.set_mesh(mesh):
        got, got_grad = jax.jit(body)(table, ids, ct)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-5, atol=1e-5)


def test_lookup_inside_a_manual_region_has_no_gather_over_the_split_vocabulary():
    """Inside the stage region the table's vocabulary split is handled per device: the
    program sums the slices with an all-reduce over tp_col, and each device's gather is the
    lookup's own, reading rows of D/2 from its block."""
    mesh, rules = make_mesh("stage=2,tp_row=2,tp_col=2", jax.devices()), get_rules("primepar")
    table, ids, _ = _inputs()
    table = jax.device_put(table, NamedSharding(mesh, rules.param_spec(("vocab", "embed"), mesh)))

    def body(t, i):
        with outer_axes("stage"), use_rules(rules, mesh):
            return lookup(t, i)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                      axis_names={"stage"}, check_vma=False)
    with jax.set_mesh(mesh):
        text = jax.jit(f).lower(table, ids).compile().as_text()
    gathers = [line for line in text.splitlines() if " gather(" in line]
    assert gathers and all(f"slice_sizes={{1,{D // 2}}}" in line
                           and "shard_map/shard_map" in line for line in gathers), gathers
    assert "all-reduce" in text
