"""oases-jax core: meshes, logical sharding rules and collectives, in pure JAX (no Flax)."""

from oases_jax.errors import UserError
from oases_jax.mesh import MeshSpec, make_mesh, parse_mesh
from oases_jax.rules import RULE_SETS, ShardingRules, get_rules

__all__ = [
    "RULE_SETS",
    "MeshSpec",
    "ShardingRules",
    "UserError",
    "get_rules",
    "make_mesh",
    "parse_mesh",
]
