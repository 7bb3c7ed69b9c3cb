"""Top-k routing with a fixed capacity per (token group, expert) cell: gate, slot positions, the
deterministic drop rule, and the statistics of the router losses (docs/parallelism.md, MoE).

Everything here runs on one group of tokens (one device's block under a schedule, or the whole
batch without a mesh) with static shapes: no host syncs, one compile for all batches.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def capacity(tokens: int, experts: int, top_k: int, factor: float, multiple: int = 1) -> int:
    """Slots per expert for a group of `tokens`: ceil(f * k * T / E), at least 1 and at most T
    (a token picks k distinct experts, so an expert never receives more than T), rounded up to a
    `multiple`. The product is rounded to 6 decimals first so that 1.1 * 2 * 80 / 8 is 22,
    not 23 from float noise."""
    c = max(1, min(tokens, math.ceil(round(factor * top_k * tokens / experts, 6))))
    return -(-c // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Routing:
    """One group's routing. T tokens, k choices, E experts, capacity C.

    expert_TK:  chosen experts, best first (ties to the lowest expert id)
    gate_TK:    their weights (float32)
    pos_TK:     each choice's slot in its expert's buffer (first choices of all tokens in token
                order, then second choices, ...); kept iff pos < C
    kept_TK:    pos < C
    stats:      sums over the group for the router losses (`router_stats`)
    """

    expert_TK: jax.Array
    gate_TK: jax.Array
    pos_TK: jax.Array
    kept_TK: jax.Array
    stats: dict


def route(x_TD: jax.Array, router_DE: jax.Array, *, top_k: int, capacity: int,
          norm_topk: bool) -> Routing:
    """Gate the tokens of one group and give each choice its slot."""
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), router_DE.astype(jnp.float32))
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    gate_TK, expert_TK = jax.lax.top_k(probs_TE, top_k)  # equal values: lower index first
    if norm_topk:
        gate_TK = gate_TK / jnp.sum(gate_TK, axis=-1, keepdims=True)
    n_experts = router_DE.shape[-1]
    # Priority: choice rank first, then token order (GShard): a token's second choice never
    # takes a slot from another token's first choice.
    onehot_KTE = jax.nn.one_hot(expert_TK.T, n_experts, dtype=jnp.int32)
    flat = onehot_KTE.reshape(-1, n_experts)
    before = jnp.cumsum(flat, axis=0) - flat  # earlier choices routed to the same expert
    pos_TK = jnp.sum(before * flat, axis=-1).reshape(top_k, -1).T
    kept_TK = pos_TK < capacity
    stats = router_stats(logits_TE, probs_TE, onehot_KTE, kept_TK)
    return Routing(expert_TK, gate_TK, pos_TK, kept_TK, stats)


def router_stats(logits_TE, probs_TE, onehot_KTE, kept_TK) -> dict:
    """Sums over the group that the router losses are made of (summed again over groups, so the
    losses are those of the global batch whatever the mesh): tokens, routed choices per expert
    (not differentiable), router probability per expert, squared log-partition, dropped
    choices."""
    return {
        "tokens": jnp.float32(logits_TE.shape[0]),
        "count_E": jax.lax.stop_gradient(jnp.sum(onehot_KTE, axis=(0, 1)).astype(jnp.float32)),
        "prob_E": jnp.sum(probs_TE, axis=0),
        "z": jnp.sum(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1))),
        "dropped": jnp.sum(1.0 - kept_TK.astype(jnp.float32)),
    }


def router_losses(stats: dict, top_k: int) -> dict:
    """From summed `router_stats`: the Switch load-balancing loss E * sum_e f_e * P_e (f_e the
    fraction of the k*T choices routed to e, P_e the mean router probability of e; 1.0 when
    perfectly balanced), the router z-loss mean_t logsumexp(logits_t)^2, and the fraction of
    choices dropped by capacity."""
    t = stats["tokens"]
    n_experts = stats["count_E"].shape[0]
    f_E = stats["count_E"] / (t * top_k)
    p_E = stats["prob_E"] / t
    return {"aux_loss": n_experts * jnp.sum(f_E * p_E), "z_loss": stats["z"] / t,
            "dropped_frac": jax.lax.stop_gradient(stats["dropped"] / (t * top_k))}


def slot_index(r: Routing, capacity: int, slots: int | None = None, offset: int = 0) -> jax.Array:
    """Each choice's row in a flat [E * slots] buffer, or E * slots (one past the end) where it
    is dropped or falls outside the window [offset, offset + slots) of positions."""
    slots = capacity if slots is None else slots
    local = r.pos_TK - offset
    inside = r.kept_TK & (local >= 0) & (local < slots)
    return jnp.where(inside, r.expert_TK * slots + local, -1)


def dispatch(x_TD: jax.Array, r: Routing, n_experts: int, capacity: int, *,
             slots: int | None = None, offset: int = 0) -> jax.Array:
    """The expert buffer [E, slots, D]: slot (e, p) holds the token whose choice of e got
    position offset + p; empty slots are zero. A gather (its gradient a scatter-add)."""
    slots = capacity if slots is None else slots
    t = x_TD.shape[0]
    idx_TK = slot_index(r, capacity, slots, offset)
    size = n_experts * slots
    token_TK = jnp.broadcast_to(jnp.arange(t)[:, None], idx_TK.shape)
    # Kept slots are unique, so the scatter writes each at most once; the rest go to `size`.
    slot_token = jnp.full((size + 1,), t, jnp.int32).at[
        jnp.where(idx_TK < 0, size, idx_TK).reshape(-1)].set(token_TK.reshape(-1).astype(
            jnp.int32))[:size]
    x_pad = jnp.concatenate([x_TD, jnp.zeros((1, x_TD.shape[1]), x_TD.dtype)])
    return x_pad[slot_token].reshape(n_experts, slots, x_TD.shape[1])


def combine(y_ESD: jax.Array, r: Routing, capacity: int, *, offset: int = 0) -> jax.Array:
    """Each token's output: sum over its kept choices of gate * the expert output in its slot
    (slots outside [offset, offset + S) count as dropped here: another device holds them)."""
    n_experts, slots, d = y_ESD.shape
    idx_TK = slot_index(r, capacity, slots, offset)
    size = n_experts * slots
    y_pad = jnp.concatenate([y_ESD.reshape(size, d), jnp.zeros((1, d), y_ESD.dtype)])
    rows_TKD = y_pad[jnp.where(idx_TK < 0, size, idx_TK)]
    return jnp.einsum("tk,tkd->td", r.gate_TK.astype(y_ESD.dtype), rows_TKD)
