"""An MoE feed-forward written plainly for one device, independently of `oases_jax.moe`:
GShard-style one-hot dispatch and combine tensors built by einsum, top-k by repeated argmax,
slot positions by per-choice cumulative sums. Tokens come as [G, T, D]: G groups, each with its
own capacity, as the sharded schedules form them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def experts_ffn(e_ECD, w, gated: bool):
    """Every expert's FFN on its slots: GELU (tanh form) with biases, or SwiGLU."""
    h = jnp.einsum("ecd,edf->ecf", e_ECD, w["w_in"])
    if "b_in" in w:
        h = h + w["b_in"][:, None, :]
    if gated:
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", e_ECD, w["w_gate"])) * h
    else:
        h = jax.nn.gelu(h, approximate=True)
    y = jnp.einsum("ecf,efd->ecd", h, w["w_out"])
    if "b_out" in w:
        y = y + w["b_out"][:, None, :]
    return y


def moe_reference(x_GTD, router_DE, w, *, top_k: int, capacity: int, norm_topk: bool,
                  gated: bool):
    """(out [G, T, D], {"aux_loss", "z_loss", "dropped_frac"}, routing): routing["expert"]
    [G, T, k] the chosen experts, routing["kept"] [G, T, k] 1 where the choice got a slot."""
    g, t, d = x_GTD.shape
    e = router_DE.shape[1]
    outs, experts, kept = [], [], []
    count_E = jnp.zeros(e)
    prob_E = jnp.zeros(e)
    z = 0.0
    kept_total = 0.0
    for gi in range(g):
        x_TD = x_GTD[gi]
        logits = x_TD.astype(jnp.float32) @ router_DE.astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        remaining = probs
        masks, gates = [], []
        chosen = []
        for _ in range(top_k):
            idx = jnp.argmax(remaining, axis=-1)  # the first maximum: the lowest expert id
            m = jax.nn.one_hot(idx, e)
            chosen.append(idx)
            masks.append(m)
            gates.append(jnp.sum(probs * m, axis=-1))
            remaining = jnp.where(m > 0, -jnp.inf, remaining)
        if norm_topk:
            total = sum(gates)
            gates = [gt / total for gt in gates]
        dispatch = jnp.zeros((t, e, capacity))
        comb = jnp.zeros((t, e, capacity))
        offset = jnp.zeros(e)
        keep_TE = jnp.zeros((t, e))
        kept_choice = []
        for m, gt in zip(masks, gates, strict=True):
            loc = jnp.cumsum(m, axis=0) - 1 + offset[None, :]
            offset = offset + jnp.sum(m, axis=0)
            keep = m * (loc < capacity)
            keep_TE = keep_TE + keep
            kept_choice.append(jnp.sum(keep, axis=-1))
            slot = jax.nn.one_hot(jnp.sum(loc * m, axis=-1).astype(jnp.int32), capacity)
            dispatch = dispatch + keep[:, :, None] * slot[:, None, :]
            comb = comb + (gt[:, None] * keep)[:, :, None] * slot[:, None, :]
        e_ECD = jnp.einsum("tec,td->ecd", dispatch, x_TD)
        y_ECD = experts_ffn(e_ECD, w, gated)
        outs.append(jnp.einsum("tec,ecd->td", comb, y_ECD))
        experts.append(jnp.stack(chosen, axis=-1))
        kept.append(jnp.stack(kept_choice, axis=-1).astype(jnp.int32))
        count_E = count_E + sum(jnp.sum(m, axis=0) for m in masks)
        prob_E = prob_E + jnp.sum(probs, axis=0)
        z = z + jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
        kept_total = kept_total + jnp.sum(keep_TE)
    n = g * t
    aux = e * jnp.sum(jax.lax.stop_gradient(count_E) / (n * top_k) * prob_E / n)
    losses = {"aux_loss": aux, "z_loss": z / n, "dropped_frac": 1.0 - kept_total / (n * top_k)}
    return jnp.stack(outs), losses, {"expert": jnp.stack(experts), "kept": jnp.stack(kept)}
