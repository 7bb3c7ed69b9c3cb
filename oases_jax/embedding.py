"""Token-embedding lookup under the active rules, also inside a region manual over some axes
(a pipeline's stage loop), where XLA's partitioner cannot partition the gather itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from oases_jax import compat
from oases_jax.rules import active_rules, entry_axes, spec_divides


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def lookup(table_VD: jax.Array, ids_BL: jax.Array) -> jax.Array:
    """`jnp.take(table_VD, ids_BL, axis=0)`, the rows of `table_VD` (sharded by the rules'
    ("vocab", "embed")) for token ids sharded as ("batch", "seq").

    Outside a manual region this is the plain gather, partitioned by XLA. Inside one, XLA's
    SPMD partitioner aborts on a gather whose table is split over its vocabulary beside other
    split axes (spmd_partitioner_util.cc:498, seen with PrimePar's and fsdp_tp's rules inside
    the stage loop), so the lookup is written per device, as a vocabulary-parallel embedding:
    each device gathers the ids that fall in its slice of the vocabulary (zeros for the others)
    and the slices are summed over the vocabulary's axes. The output is [B, L, D] with the
    ids' batch sharding and the table's embed sharding; a batch axis that the table's embed
    dimension also uses is dropped from the ids (they are small), not gathered into the table.
    """
    active = active_rules()
    if active is None or not compat.manual_axes():
        return jnp.take(table_VD, ids_BL, axis=0)
    rules, mesh = active
    outer = compat.manual_axes()  # the specs below already leave `outer_axes` out
    t_spec = rules.param_spec(("vocab", "embed"), mesh)
    vocab, embed = (tuple(a for a in entry_axes(e) if a not in outer) for e in t_spec)
    if not vocab:
        return jnp.take(table_VD, ids_BL, axis=0)  # a gather the partitioner handles
    if spec_divides(table_VD.shape, P(_entry(vocab), _entry(embed)), mesh) is not None:
        return jnp.take(table_VD, ids_BL, axis=0)
    i_spec = rules.act_spec(("batch", "seq"), mesh)
    i_spec = P(*(_entry(tuple(a for a in entry_axes(e) if a not in embed + vocab + tuple(outer)))
                 for e in i_spec))
    if spec_divides(ids_BL.shape, i_spec, mesh) is not None:
        i_spec = P()

    def local(t_vd, i_bl):
        # t_vd: [V/vocab, D/embed]; i_bl: this device's ids, any of the V ids
        rows = t_vd.shape[0]
        first = jax.lax.axis_index(vocab) * rows
        mine = (i_bl >= first) & (i_bl < first + rows)
        x = jnp.take(t_vd, jnp.where(mine, i_bl - first, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], x, jnp.zeros_like(x)), vocab)

    out_spec = P(*(tuple(i_spec) + (None,) * (2 - len(i_spec))), _entry(embed))
    return jax.shard_map(local, mesh=compat.context_mesh(mesh),
                         in_specs=(P(_entry(vocab), _entry(embed)), i_spec),
                         out_specs=out_spec)(table_VD, ids_BL)
