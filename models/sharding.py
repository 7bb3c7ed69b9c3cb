"""Bind a model's logical parameter names to a mesh: shardings, checks, and sharded init."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig
from oases_jax.models.transformer import Transformer
from oases_jax.rules import ShardingRules, spec_divides


def _path_str(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_names(state: nnx.State) -> nnx.State:
    """The logical axis tuple of every Variable in `state` (from its `out_sharding` metadata)."""
    return jax.tree.map(_logical, state, is_leaf=_is_var)


def _logical(v: nnx.Variable) -> tuple[str | None, ...]:
    return tuple(v.get_metadata().get("out_sharding") or (None,) * len(v.get_value().shape))


def param_shardings(state: nnx.State, rules: ShardingRules, mesh: Mesh) -> nnx.State:
    """NamedShardings for `state` (arrays or ShapeDtypeStructs) under the parameter rules, as a
    State of the same structure (each Variable holds its sharding).

    Raises UserError naming the parameter, dimension and mesh axis when a size does not divide.
    """

    def one(path, var):
        logical, shape = _logical(var), var.get_value().shape
        spec = rules.param_spec(logical, mesh)
        bad = spec_divides(shape, spec, mesh)
        if bad is not None:
            axes = spec[bad] if isinstance(spec[bad], tuple) else (spec[bad],)
            sizes = ",".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise UserError(
                f"parameter {_path_str(path)} dim {bad} ({logical[bad]}={shape[bad]}) is not "
                f"divisible by mesh axis {sizes} under rules {rules.name!r}; pick a mesh size that "
                f"divides {shape[bad]} or another rule set"
            )
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes only: nothing is allocated (full-size presets are used this way)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def init_sharded(cfg: ModelConfig, rules: ShardingRules, mesh: Mesh, seed: int) -> Transformer:
    """Create the model with every parameter born on its shard (no host-side full copy)."""
    graphdef, abstract = abstract_model(cfg)
    shardings = param_shardings(abstract, rules, mesh)

    @jax.jit
    def create(key):
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=key)))

    with jax.set_mesh(mesh):
        state = jax.jit(create, out_shardings=shardings)(jax.random.key(seed))
    return nnx.merge(graphdef, state)
