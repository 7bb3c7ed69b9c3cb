"""The pipelined step of a cut user model: the stage layout of its parameters and the stage
program the project's executor runs (`oases_jax.pipeline.executor`), as
`training.pipeline_step` does for the project's own transformer.

Parameters are `{"blocks": [leaf [S, v, Lmax, ...] per block leaf], "shared": (leaf, ...)}`:
block leaves sharded on `stage` (then on `tensor` as the block's tensor map says), the shared
ones (embedding, head, everything outside the blocks) replicated over `stage` and summed over
it once per step, as the project's pipeline does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.pipeline import executor
from oases_jax.rules import constrain, outer_axes
from oases_jax.training.parallelize.graph import Cut, run
from oases_jax.training.pipeline_layout import STAGE, PipelineSpec


class _Micro:
    """The executor indexes its data by micro-batch: `data_M[m]`; a user batch is a pytree."""

    def __init__(self, tree):
        self.tree = tree

    def __getitem__(self, m):
        return jax.tree.map(lambda a: a[m], self.tree)


def to_stages(stacked: list, pipe: PipelineSpec) -> list:
    """Block leaves [L, ...] -> [S, v, Lmax, ...], padding rows zero."""
    idx, mask = pipe.index()

    def one(a):
        m = jnp.asarray(mask).reshape(mask.shape + (1,) * (a.ndim - 1))
        return jnp.where(m, a[jnp.asarray(idx)], jnp.zeros((), a.dtype))
    return [one(a) for a in stacked]


def from_stages(staged: list, pipe: PipelineSpec) -> list:
    """The inverse of `to_stages`, on the host (numpy)."""
    idx, mask = pipe.index()
    where = np.stack([np.argwhere((idx == i) & mask)[0] for i in range(sum(pipe.layers))])
    return [np.asarray(a)[where[:, 0], where[:, 1], where[:, 2]] for a in staged]


def shardings(mesh: Mesh, block_specs, shared_specs):
    return {"blocks": [NamedSharding(mesh, P(STAGE, None, None, *s)) for s in block_specs],
            "shared": tuple(NamedSharding(mesh, P(*s)) for s in shared_specs)}


def block_call(graphdef, treedef, call: tuple):
    """fn(layer leaves, x, side arrays) -> the user's block called on x as the loss calls it."""
    tree, statics = call

    def apply(layer_leaves, x, side):
        it = iter(side)
        leaves = [next(it) if s is None else s for s in statics]
        args, kwargs = jax.tree.unflatten(tree, leaves)
        block = nnx.merge(graphdef, jax.tree.unflatten(treedef, layer_leaves))
        return block(x, *args, **kwargs)

    return apply


def layer_stack(one):
    """fn(stacked leaves [n, ...], x, side, remat) -> x after n layers of `one(leaves, x, side)`,
    a scan over the layers."""
    def layers(stacked, x, side, remat: bool):
        def body(x, layer_leaves):
            # The residual stream stays whole on every tensor rank (Megatron): each block's
            # column layers read it as it is, its row layers' partial sums are reduced into it.
            whole = (None,) * x.ndim
            return constrain(one(layer_leaves, constrain(x, whole), side), whole), None
        if remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        return jax.lax.scan(body, x, stacked)[0]

    return layers


def stage_program(cut: Cut, layers_fn, pipe: PipelineSpec, act: jax.ShapeDtypeStruct
                  ) -> executor.StageProgram:
    V, S = pipe.virtual, pipe.stages
    n_j, k_j = pipe.virtual_layers(), pipe.recomputed()
    side = set(cut.side.reads)

    def keys(j):
        ks = set(side)
        if j == 0:
            ks |= set(cut.pre.reads)
        if j == V - 1:
            ks |= set(cut.post.reads)
        return sorted(ks)

    def prepare(local):
        """Once per step, outside the tick loop: each chunk's block leaves as arrays of their
        own, so a branch whose stage fills its chunk takes them without a copy."""
        return {"blocks": [tuple(a[c] for c in range(a.shape[0])) for a in local["blocks"]],
                "shared": local["shared"]}

    def params(j, q):
        c, n = j // S, n_j[j]

        def pick(prepared):
            return {"blocks": [a[c][:n] for a in prepared["blocks"]],  # a full slice is a[c]
                    "shared": {i: prepared["shared"][i] for i in keys(j)}}
        return pick

    def add_grads(j, q):
        c, n = j // S, n_j[j]

        def add(acc, g):
            blocks = [a.at[c, :n].add(b.astype(a.dtype)) for a, b in
                      zip(acc["blocks"], g["blocks"], strict=True)]
            shared = list(acc["shared"])
            for i, v in g["shared"].items():
                shared[i] = shared[i] + v.astype(shared[i].dtype)
            return {"blocks": blocks, "shared": tuple(shared)}
        return add

    def forward(j, q):
        n, k = n_j[j], k_j[j]

        def f(pj, x, data_mb):
            shared = [None] * cut.n_shared
            for i, v in pj["shared"].items():
                shared[i] = v
            batch = jax.tree.leaves(data_mb)
            if j == 0:
                x = run(cut.pre, cut, shared, batch)[0]
            extra = run(cut.side, cut, shared, batch)
            blocks = pj["blocks"]
            if k:
                x = layers_fn([a[:k] for a in blocks], x, extra, True)
            if n > k:
                x = layers_fn([a[k:] for a in blocks], x, extra, False)
            if j == V - 1:
                return run(cut.post, cut, shared, batch, start_value=x)[0]
            return x.astype(act.dtype)
        return f

    # Every backward runs in one tick (one part per stage, q = 0): a user's block has no cost
    # model to balance a backward split over several ticks by.
    return executor.StageProgram(forward=forward, params=params, add_grads=add_grads, act=act,
                                 parts=(1,) * V, prepare=prepare)


def grads_fn(mesh: Mesh, pipe: PipelineSpec, prog: executor.StageProgram, groups: int):
    """(params, batch [M, b, ...]) -> (mean loss, mean gradients) in the stage layout."""
    manual = {STAGE} | ({"data"} if groups > 1 else set())
    plan = executor.plan(pipe.schedule_table(), fuse=pipe.fused())
    batch_spec = P(None, "data") if groups > 1 else P()

    def grads(params, batch_M):
        M = jax.tree.leaves(batch_M)[0].shape[0]
        p_specs = {"blocks": [P(STAGE)] * len(params["blocks"]),
                   "shared": tuple(P() for _ in params["shared"])}

        def local(params_in, batch):
            params = {"blocks": [a[0] for a in params_in["blocks"]],
                      "shared": params_in["shared"]}
            with outer_axes(*manual):
                loss, acc = executor.run(plan, prog, params, _Micro(batch), stage_axis=STAGE)
            acc = {"blocks": [a[None] for a in acc["blocks"]],
                   "shared": jax.lax.psum(tuple(acc["shared"]), STAGE)}
            loss = jax.lax.psum(loss, STAGE)
            if groups > 1:
                loss, acc = jax.lax.psum((loss, acc), "data")
            return loss, acc

        loss, g = jax.shard_map(local, mesh=mesh, in_specs=(p_specs, batch_spec),
                                out_specs=(P(), p_specs), axis_names=manual,
                                check_vma=False)(params, batch_M)
        scale = 1.0 / (M * groups)
        return loss * scale, jax.tree.map(lambda a: a * scale, g)

    return grads
