"""Step orders (Oases): the order of work inside a transformer layer, as plain data.

A micro-batch is split into k sub-batches along the batch. Each sub-layer (attention, MLP) of
each sub-batch ends in a tensor-parallel collective; ordering the work as

    attn(0) attn(1) ... attn(k-1)  mlp(0) mlp(1) ... mlp(k-1)

lets the collective of sub-batch b run while sub-batch b+1 computes. The backward pass is the
same order reversed, so there too one sub-batch's collective overlaps another's compute.
`run` executes one layer (split, steps, join); `run_overlapped` executes one layer of a stack
whose sub-batches stay split between layers and whose last step's collective (mlp(k-1)'s) is
left pending for the next layer, which completes it while its attn(0) .. attn(k-2) compute.
XLA's scheduler keeps the collectives asynchronous because the sub-batches share no data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


@jax.custom_jvp
def pin(xs):
    """`jax.lax.optimization_barrier` for the forward's order only: the values of `xs` become
    available together, so XLA may not move work across the point, while their derivatives
    pass through unpinned. A plain barrier's transpose is a barrier over the cotangents, and the
    forward's pins, transposed, made each sub-batch's backward wait for the next one's dX
    all-reduce: the backward ran its all-reduces one after another with nothing beside them."""
    return jax.lax.optimization_barrier(xs)


@pin.defjvp
def _pin_jvp(primals, tangents):
    return jax.lax.optimization_barrier(primals[0]), tangents[0]


@jax.custom_vjp
def tie_backward(a, b):
    """`(a, b)` unchanged; in the backward their cotangents become available together, so the
    work on a's cotangent waits until b's is computed. The forward is not constrained."""
    return a, b


def _tie_fwd(a, b):
    return (a, b), None


def _tie_bwd(_, cts):
    return tuple(jax.lax.optimization_barrier(cts))


tie_backward.defvjp(_tie_fwd, _tie_bwd)


@dataclasses.dataclass(frozen=True)
class Step:
    op: str  # "attn" or "mlp": a residual sub-layer, x <- x + op(x)
    sub_batch: int


@dataclasses.dataclass(frozen=True)
class StepOrder:
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


def oases(sub_batches: int) -> StepOrder:
    """Ping-pong order: every sub-batch's attention, then every sub-batch's MLP."""
    if sub_batches < 1:
        raise ValueError(f"sub_batches={sub_batches} must be >= 1")
    return StepOrder(sub_batches, tuple(
        Step(op, b) for op in ("attn", "mlp") for b in range(sub_batches)))


def sequential() -> StepOrder:
    return StepOrder(1, (Step("attn", 0), Step("mlp", 0)))


def split(order: StepOrder, x_BLD: jax.Array) -> tuple[jax.Array, ...]:
    """The k sub-batches of x. Sub-batch j takes rows j, j+k, j+2k, ...: every data shard keeps
    its own rows, so splitting and joining move no data between devices."""
    k, b = order.sub_batches, x_BLD.shape[0]
    if b % k:
        raise ValueError(f"batch of {b} does not split into {k} sub-batches")
    grouped = x_BLD.reshape(b // k, k, *x_BLD.shape[1:])
    xs = tuple(grouped[:, j] for j in range(k))
    if k > 1:  # materialise the sub-batches: no later fusion may slice one out of x again
        xs = tuple(pin(xs))
    return xs


def join(xs: Sequence[jax.Array]) -> jax.Array:
    """The inverse of `split`."""
    stacked = jnp.stack(xs, axis=1)
    return stacked.reshape(-1, *stacked.shape[2:])


def run(order: StepOrder, x_BLD: jax.Array, ops: dict[str, Callable[[jax.Array], jax.Array]],
        constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
        before_step: Callable[[jax.Array], jax.Array] = lambda x: x,
        after_step: Callable[[jax.Array], None] = lambda x: None,
        settle: Callable[[jax.Array], jax.Array] = lambda x: x) -> jax.Array:
    """Execute `order` on x: split the batch into sub-batches, apply each residual step in
    order, and join the sub-batches again. `before_step` sees each step's input first,
    `after_step` each step's output, and `settle` the previous step's output once the next step
    ran, returning it as the rest of the layer uses it (a manual layer's projection uses them to
    pin the order of work forward and backward, see `oases_jax.projections.LocalAllReduce`)."""
    xs = list(split(order, x_BLD))
    prev = None
    for step in order.steps:
        x = before_step(xs[step.sub_batch])
        out = ops[step.op](x)
        with jax.named_scope("residual"):
            xs[step.sub_batch] = constrain(x + out)
        if prev is not None and prev != step.sub_batch:
            xs[prev] = settle(xs[prev])
        after_step(xs[step.sub_batch])
        prev = step.sub_batch
    return join(xs)


def run_overlapped(order: StepOrder, xs: Sequence[jax.Array], pending: Any,
                  ops: dict[str, Callable[[jax.Array], jax.Array]],
                  defer: Callable[[jax.Array], Any], complete: Callable[[Any], jax.Array],
                  before_step: Callable[[jax.Array], jax.Array] = lambda x: x,
                  after_step: Callable[[jax.Array], None] = lambda x: None,
                  settle: Callable[[jax.Array], jax.Array] = lambda x: x,
                  ) -> tuple[tuple[jax.Array, ...], Any]:
    """One layer of an overlapped stack, on sub-batches `xs` that stay split between
    layers. The order's last step (its sub-batch `s`) is left unfinished: `defer(x)` returns
    its pre-collective state (`pending`) and xs[s] stays that step's input, so the true xs[s] is
    xs[s] + complete(pending). A layer given the previous layer's `pending` completes it just
    before its first step on sub-batch s: the collective runs while the steps before that
    (attn(0) .. attn(s-1) under `oases`) compute. Finish the stack with `finish_pending`. The
    hooks are `run`'s."""
    xs = list(xs)
    last = order.steps[-1]
    new_pending = None
    for i, step in enumerate(order.steps):
        if i and order.steps[i - 1].sub_batch != step.sub_batch:
            prev = order.steps[i - 1].sub_batch
        else:
            prev = None
        if pending is not None and step.sub_batch == last.sub_batch:
            xs, pending = list(finish_pending(order, xs, pending, complete)), None
        x = before_step(xs[step.sub_batch])
        if i == len(order.steps) - 1:
            xs[step.sub_batch], new_pending = x, defer(x)
        else:
            out = ops[step.op](x)
            with jax.named_scope("residual"):
                xs[step.sub_batch] = x + out
        if prev is not None:
            xs[prev] = settle(xs[prev])
        if i < len(order.steps) - 1:
            after_step(xs[step.sub_batch])
    return tuple(xs), new_pending


def finish_pending(order: StepOrder, xs: Sequence[jax.Array], pending: Any,
                   complete: Callable[[Any], jax.Array]) -> tuple[jax.Array, ...]:
    """Complete the step `run_overlapped` left pending (at the end of a stack)."""
    xs = list(xs)
    s = order.steps[-1].sub_batch
    xs[s] = xs[s] + complete(pending)
    return tuple(xs)
