"""Parameter layouts of the schedules: `primepar` stores each projection weight with its blocks
permuted (see oases_jax.primepar); checkpoints and exports hold the standard layout."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from oases_jax import registry
from oases_jax.primepar import relayout_pairs
from oases_jax.rules import ShardingRules

_OUT = ("heads", "kv_heads", "mlp")


def weight_kind(names: tuple) -> str | None:
    """"column" for D -> heads/mlp weights, "row" for heads/mlp -> D, else None."""
    names = tuple(n for n in names if n != "layers")
    if len(names) >= 2 and names[0] == "embed" and names[1] in _OUT:
        return "column"
    if len(names) >= 2 and names[-1] == "embed" and names[0] in _OUT:
        return "row"
    return None


def relayout(tree, rules: ShardingRules, mesh: Mesh, *, stored: bool, rows: str = "tp_row",
             cols: str = "tp_col"):
    """`tree` (parameters, or a train state: Adam's moments are Variables with the same names)
    with every projection weight moved to primepar's stored layout (`stored=True`) or back to
    the standard one: one ppermute over the square per weight. Identity without a square."""
    q = mesh.shape.get(rows, 1)
    if q == 1:
        return tree

    def one(var):
        if not isinstance(var, nnx.Variable):
            return var
        names = tuple(var.get_metadata().get("out_sharding") or ())
        kind = weight_kind(names)
        if kind is None:
            return var
        spec = rules.param_spec(names, mesh)
        pairs = relayout_pairs(kind, q, stored=stored)
        move = jax.shard_map(lambda a: jax.lax.ppermute(a, (rows, cols), pairs), mesh=mesh,
                             in_specs=spec, out_specs=spec)
        return var.replace(move(var.get_value()))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def layout_fns(schedule: str, rules: ShardingRules, mesh: Mesh):
    """(to_stored, to_standard) for the schedule's weight layout (`ScheduleSpec.weight_layout`);
    identities for the standard layout. Both are jitted and keep each array's sharding."""
    if registry.get(schedule).weight_layout != "primepar" or mesh.shape.get("tp_row", 1) == 1:
        return (lambda tree: tree), (lambda tree: tree)
    return (jax.jit(functools.partial(relayout, rules=rules, mesh=mesh, stored=True)),
            jax.jit(functools.partial(relayout, rules=rules, mesh=mesh, stored=False)))


def standard_model(model: nnx.Module, rules: ShardingRules, mesh: Mesh) -> nnx.Module:
    """A copy of a primepar-trained model in the standard layout, e.g. for `models.hf.export_hf`."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, layout_fns("primepar", rules, mesh)[1](state))
