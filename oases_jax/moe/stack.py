"""The runner of an MoE model's layer stack: one scan over layer groups (moe_every - 1 dense
layers and one MoE layer), whose carry adds up the MoE layers' router losses. A sibling of the
runners in `oases_jax.stacks`: the dense parts run under the segment's projection strategy,
rules and remat policy exactly as a `scan` segment does, the MoE feed-forward under the run's
MoE setup (`Parallel.moe`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from oases_jax import projections, registry, remat, stacks
from oases_jax.errors import UserError
from oases_jax.moe.layer import MoESetup, use_moe
from oases_jax.rules import constrain, use_rules

RESIDUAL = projections.RESIDUAL


@dataclasses.dataclass(frozen=True)
class GroupFns:
    """One layer group as a pure function of its state (no stacked axis):
    run(state, x, constrain) -> (x, {loss name: scalar}); `losses` names what it returns."""

    run: Callable[[Any, jax.Array, Callable], tuple[jax.Array, dict]]
    losses: tuple[str, ...]


def _scan(layer: Callable, stacked, carry, scan: bool):
    if scan:
        return jax.lax.scan(lambda c, st: (layer(c, st), None), carry, stacked)[0]
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        carry = layer(carry, jax.tree.map(lambda a, i=i: a[i], stacked))
    return carry


def _add(acc: dict, losses: dict) -> dict:
    return {k: acc[k] + losses[k].astype(jnp.float32) for k in acc}


def scan_schedules() -> tuple[str, ...]:
    """Tensor-parallel schedules whose layers run in a plain scan (what MoE groups need)."""
    return tuple(n for n, s in registry.SCHEDULES.items()
                 if not s.sub_batches and s.rules != "primepar")


def run_groups(fns: GroupFns, stacked, x_BLD: jax.Array, *, scan: bool = True,
               remat_default: str | None = None) -> tuple[jax.Array, dict]:
    """All groups of `stacked` on x under the active `Parallel` (or plainly without one):
    (x, the MoE layers' losses summed over the groups)."""
    zero = {k: jnp.zeros((), jnp.float32) for k in fns.losses}
    parallel = stacks.active()
    if parallel is None:
        def plain(carry, state):
            x, acc = carry
            x, losses = fns.run(state, x, lambda y: y)
            return x, _add(acc, losses)

        policy = remat.policy(remat_default or "none")
        if policy is not None:
            plain = jax.checkpoint(plain, policy=policy, prevent_cse=not scan)
        return _scan(plain, stacked, (x_BLD, zero), scan)
    if parallel.layers is not None:
        raise UserError("per-layer plans do not cover MoE models yet; run an MoE model with "
                        "--schedule and --moe-schedule instead of --plan")
    layer_spec = parallel.default
    if remat_default is not None:
        layer_spec = dataclasses.replace(layer_spec, remat=remat_default)
    seg = parallel.segment(layer_spec)
    if seg.runner != "scan":
        raise UserError(f"--schedule {layer_spec.schedule} runs its layers inside one shard_map, "
                        f"which MoE layers do not join yet; use one of "
                        f"{', '.join(scan_schedules())}")
    setup = getattr(parallel, "moe", None) or MoESetup()
    proj = seg.projection()

    def layer(carry, state):
        x, acc = carry
        with projections.use(proj), use_moe(setup, seg.rules, seg.mesh):
            x, losses = fns.run(state, x, lambda y: constrain(y, RESIDUAL))
        return x, _add(acc, losses)

    with use_rules(seg.rules, seg.mesh):
        x_BLD = constrain(x_BLD, RESIDUAL)
        x_BLD, losses = _scan(seg.wrap(layer, scan), stacked, (x_BLD, zero), scan)
    return constrain(x_BLD, RESIDUAL), losses
