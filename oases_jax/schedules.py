"""Sub-batch schedules (Oases): the order of work inside a transformer layer, as plain data.

A micro-batch is split into k sub-batches along the batch. Each sub-layer (attention, MLP) of
each sub-batch ends in a tensor-parallel collective; ordering the work as

    attn(0) attn(1) ... attn(k-1)  mlp(0) mlp(1) ... mlp(k-1)

lets the collective of sub-batch b run while sub-batch b+1 computes (and, across the boundary,
mlp(k-1)'s collective run while the next layer's attn(0) computes). The backward pass is the
same order reversed, so there too one sub-batch's collective overlaps another's compute.
`run` is the one executor; XLA's scheduler keeps the collectives asynchronous because the
sub-batches share no data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Step:
    op: str  # "attn" or "mlp": a residual sub-layer, x <- x + op(x)
    sub_batch: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    sub_batches: int
    steps: tuple[Step, ...]

    def pretty(self) -> str:
        """One line per step, with the collective each step's compute hides."""
        lines = [f"{self.sub_batches} sub-batches"]
        for i, s in enumerate(self.steps):
            hides = self.steps[i - 1] if i else None
            note = f"   (hides the collective of {hides.op}[{hides.sub_batch}])" if hides else ""
            lines.append(f"{i:3d}  {s.op}[{s.sub_batch}]{note}")
        return "\n".join(lines)


def oases(sub_batches: int) -> Schedule:
    """Ping-pong order: every sub-batch's attention, then every sub-batch's MLP."""
    if sub_batches < 1:
        raise ValueError(f"sub_batches={sub_batches} must be >= 1")
    return Schedule(sub_batches, tuple(
        Step(op, b) for op in ("attn", "mlp") for b in range(sub_batches)))


def sequential() -> Schedule:
    return Schedule(1, (Step("attn", 0), Step("mlp", 0)))


def run(schedule: Schedule, x_BLD: jax.Array, ops: dict[str, Callable[[jax.Array], jax.Array]],
        constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
        before_step: Callable[[jax.Array], jax.Array] = lambda x: x,
        after_step: Callable[[jax.Array], None] = lambda x: None) -> jax.Array:
    """Execute `schedule` on x: split the batch into sub-batches, apply each residual step in
    order, and join the sub-batches again. `before_step` sees each step's input first and
    `after_step` each step's output (the manual Megatron layer uses them to pin the order of
    work, see `tensor_parallel.pin_order` and `tensor_parallel.anchor`)."""
    k, b = schedule.sub_batches, x_BLD.shape[0]
    if b % k:
        raise ValueError(f"batch of {b} does not split into {k} sub-batches")
    # Sub-batch j takes rows j, j+k, j+2k, ...: every data shard keeps its own rows, so
    # splitting and joining move no data between devices.
    grouped = x_BLD.reshape(b // k, k, *x_BLD.shape[1:])
    xs: list[jax.Array] = [grouped[:, j] for j in range(k)]
    if k > 1:  # materialise the sub-batches: no later fusion may slice one out of x again
        xs = list(jax.lax.optimization_barrier(tuple(xs)))
    for step in schedule.steps:
        x = before_step(xs[step.sub_batch])
        xs[step.sub_batch] = constrain(x + ops[step.op](x))
        after_step(xs[step.sub_batch])
    return jnp.stack(xs, axis=1).reshape(x_BLD.shape)
