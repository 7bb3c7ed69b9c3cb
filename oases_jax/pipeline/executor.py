"""The one pipeline executor: runs any schedule's tick table inside a `shard_map` manual over the
`stage` axis (docs/parallelism.md, "Pipeline executor").

Each tick every stage switches (`lax.switch` on its own op code: a real conditional per device)
to one of: idle, a forward that keeps its VJP residuals (F), a forward that keeps only its input
for a later recompute (F or PF of a recomputed micro-batch), a recompute (R, RrG) that rebuilds
the residuals from that input, or a backward (B) that applies the stored VJP. Outside the switch
one activation and one gradient `ppermute` per tick move what the stages sent to their
neighbours; non-circular schedules use shifts of S-1 pairs, never a wrap-around edge (interleaved
adds the S-1 -> 0 edge as its own one-pair permute, so no permute holds a ring).

Everything stateful is addressed by slots allocated offline (`plan`): received activations and
gradients wait in small receive buffers, residuals in pools shared between the virtual stages a
device holds. Residual leaves that are the stage's parameters themselves are never stored (the
backward re-traces the VJP and takes them from the live parameters), so no micro-batch keeps a
copy of the weights. Gradients accumulate in one local buffer per stage. The pools go through
the switch, whose branches read and write them in place (the program compiles with XLA's copy
insertion by region analysis, `pools.compiler_options`, without which it copied the pools
whole every tick).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from oases_jax.pipeline.lowering import (
    ACT_READ,
    ACT_STORE,
    BRANCH,
    GRAD_READ,
    GRAD_STORE,
    HEAD_MB,
    HEAD_STORE,
    KINDS,
    MB,
    SLOT_IN,
    SLOT_OUT,
    Plan,
    base_kind,
    plan,
)
from oases_jax.pipeline.pools import pool_layout

__all__ = ["ACT_READ", "ACT_STORE", "BRANCH", "GRAD_READ", "GRAD_STORE", "HEAD_MB", "HEAD_STORE",
           "KINDS", "MB", "SLOT_IN", "SLOT_OUT", "HeadProgram", "Plan", "StageProgram",
           "base_kind", "plan", "residual_layouts", "run"]


@dataclasses.dataclass(frozen=True)
class HeadProgram:
    """The head (final norm, logits, loss) run by every stage on its share of the work, after
    the tick where the last virtual stage's forward made its input (a split head).

    params(prepared) -> head_params: what the head reads of the prepared parameters, taken
        once per step.
    loss(head_params, x, data_mb) -> this stage's share of the micro-batch's loss (the shares
        sum to it), from x: the last stage's output there, zeros elsewhere. The collectives
        over the stage axis are inside, and the VJP of x is the whole gradient of the last
        stage's output on every stage.
    add_grads(acc, grads) -> acc: the gradient of `head_params` added into the accumulator's
        entries `keys` (the executor passes those alone).
    """

    params: Callable[[Any], Any]
    loss: Callable[[Any, Any, Any], Any]
    add_grads: Callable[[Any, Any], Any]
    keys: tuple[str, ...] = ()  # the accumulator's entries `add_grads` writes (all it reads)


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """What the executor runs for virtual stage j, split into `parts[j]` consecutive parts (a
    backward of stage j spans that many ticks, one part each, last part first). All pure
    functions, traced per branch.

    forward(j, q)(params_jq, x, data_mb) -> part q's output: the input of part q+1, or for the
        last part what is sent on (j < V-1) or the micro-batch's scalar loss (j = V-1; with a
        split `head`, the head's input); x is None for part 0 of j = 0, which reads its input
        from data_mb.
    prepare(local) -> prepared: what every tick reads of the device's local parameters, made
        once per step outside the tick loop (e.g. the block weights cast to the compute dtype:
        a cast inside the loop re-runs every tick, a full pass over the weights each).
    params(j, q)(prepared) -> params_jq: the parameters part q of stage j uses, taken from the
        prepared parameters (the VJP's primal, so its gradient has that structure).
    add_grads(j, q)(acc, grads_jq) -> acc: those gradients added into the local accumulator.
    act: ShapeDtypeStruct of one micro-batch's activation (what moves between stages and
        between parts).
    """

    forward: Callable[[int, int], Callable]
    params: Callable[[int, int], Callable[[Any], Any]]
    add_grads: Callable[[int, int], Callable[[Any, Any], Any]]
    act: jax.ShapeDtypeStruct
    parts: tuple[int, ...]
    prepare: Callable[[Any], Any] = lambda local: local
    head: HeadProgram | None = None  # a split head; None: the last stage's forward ends in it


def _split_residuals(vjp_fn, params_j) -> tuple[list, list[bool], Any]:
    """The VJP's residual leaves, which of them are the primal parameters themselves, and its
    tree structure."""
    leaves, tree = jax.tree.flatten(vjp_fn)
    ids = {id(p) for p in jax.tree.leaves(params_j)}
    return leaves, [id(leaf) in ids for leaf in leaves], tree


def _stored(vjp_fn, params_j) -> list:
    leaves, is_param, _ = _split_residuals(vjp_fn, params_j)
    return [leaf for leaf, ip in zip(leaves, is_param, strict=True) if not ip]


def _vjp_of(prog: StageProgram, j: int, q: int, params_jq, x, data_mb):
    fwd = prog.forward(j, q)
    if x is None:
        return jax.vjp(lambda pj: fwd(pj, None, data_mb), params_jq)
    return jax.vjp(lambda pj, xx: fwd(pj, xx, data_mb), params_jq, x)


def _part_input(prog: StageProgram, j: int, q: int):
    """What part q of stage j is traced on: None where it reads the micro-batch's data."""
    return None if (j == 0 and q == 0) else jnp.zeros(prog.act.shape, prog.act.dtype)


def residual_layouts(prog: StageProgram, local_params, data_mb) -> dict[tuple[int, int], list]:
    """Per (virtual stage j, part q): the leaves (shapes and dtypes) one micro-batch keeps for
    the backward, the VJP's residuals other than the stage's own parameters; one abstract trace
    each, inside the caller's shard_map (so each device's shapes)."""
    layouts = {}
    for j in range(len(prog.parts)):
        for q in range(prog.parts[j]):
            def trace(local, data, j=j, q=q):
                params_jq = prog.params(j, q)(prog.prepare(local))
                _, vjp_fn = _vjp_of(prog, j, q, params_jq, _part_input(prog, j, q), data)
                return _stored(vjp_fn, params_jq)

            layouts[(j, q)] = jax.eval_shape(trace, local_params, data_mb)
    return layouts


def run(p: Plan, prog: StageProgram, local_params, data_M, *, stage_axis: str = "stage",
        poison: bool = False):
    """Run the plan on this device (inside a shard_map manual over `stage_axis`): returns (sum
    of the micro-batches' losses on this device (non-zero on the last stage only), the
    gradient accumulator of `local_params`' structure, float32, summed over micro-batches).
    `poison` fills every buffer and every bubble's transfer with NaN: a correct plan never
    reads them, so the result must not change.

    One function on purpose: its helpers (store, load, the per-action branches, the tick body)
    are closures over one trace's state (the pool layout, the prepared parameters, the fill,
    the stage index), which every switch branch must share; split out, each would take that
    state as ten arguments and the tick's data flow would read less plainly, not more."""
    S, V = p.stages, p.virtual
    if p.head != (prog.head is not None):
        raise ValueError(f"the plan {'splits' if p.head else 'does not split'} the head but the "
                         f"stage program {'has' if prog.head else 'has no'} split head")
    if tuple(prog.parts) != tuple(p.table.span(j) for j in range(V)):
        raise ValueError(f"the stage program has {prog.parts} parts per virtual stage but the "
                         f"plan spans backwards over {[p.table.span(j) for j in range(V)]} ticks")
    s = jax.lax.axis_index(stage_axis)
    fill = jnp.nan if poison else 0.0
    act_aval = prog.act
    split = any(k > 1 for k in prog.parts)
    prepared = prog.prepare(local_params)  # loop-invariant: computed once, read every tick

    # A residual slot of stage j holds all its parts' leaves, part after part, in pools shared
    # by the virtual stages of a device (`pools.pool_layout`).
    layouts = residual_layouts(prog, local_params, data_M[0])
    stash_layout = {j: ([] if j == 0 else [act_aval]) for j in range(V)}
    lay = pool_layout(p, {j: [layouts[(j, q)] for q in range(prog.parts[j])] for j in range(V)},
                      stash_layout)

    def empty(shape, dtype):
        dtype = jnp.dtype(dtype)
        value = fill if jnp.issubdtype(dtype, jnp.floating) else 0
        return jnp.full(shape, value, dtype)

    # The pools go through the switch, whose branches read and write them in place.
    pools = tuple(empty((lay.size[k], *k[0]), k[1]) for k in lay.keys)

    def rows_of(leaves, what, j, q, base_q, at):
        return lay.leaf_rows(what, j, q, [p.pool_key(a.shape, a.dtype) for a in leaves],
                             base_q, at)

    def store(bufs, what, j, q, leaves, at):
        bufs = list(bufs)
        for leaf, (i, row) in zip(leaves, rows_of(leaves, what, j, q, 0, at), strict=True):
            if bufs[i].shape[0] == 1:
                # A one-row pool (Merak's: each stage frees its residuals before the next
                # micro-batch's) updated whole is no update to XLA: the pool became the
                # producer's value in the producer's layout (attention probabilities
                # key-major), and every other branch, idle lanes included, and every tick
                # transposed it back (0.94 ms each on GPT-2 1.5B, h100:16). A select keeps it
                # one buffer in the carry's layout; splitting the update into two halves did
                # too, but added halo permutes wherever the split dimension was sharded.
                bufs[i] = jnp.where(row == 0, leaf[None], bufs[i])
            else:
                bufs[i] = jax.lax.dynamic_update_index_in_dim(bufs[i], leaf, row, 0)
        return tuple(bufs)

    def load(bufs, what, j, q, layout, at):
        # A gather, not a dynamic slice: XLA's layout assignment carries a dynamic slice's
        # consumer layout back to the whole pool (a weight-gradient GEMM wants its residual
        # token-minor), and the switch then returned the pool transposed every tick; a gather's
        # operand keeps the carry's layout and the loaded slot alone is transposed
        # (docs/parallelism.md, "Pipeline executor").
        return [jnp.take(bufs[i], row, axis=0, mode="clip")
                for i, row in rows_of(layout, what, j, q, q, at)]

    no_send = jnp.full(act_aval.shape, fill, act_aval.dtype)

    def finish(j, out, loss):
        """A stage's output: the loss on the last stage (with a split head, the head's input),
        else the activation sent on."""
        if j == V - 1 and prog.head is None:
            return loss + out.astype(jnp.float32), no_send
        return loss, out.astype(act_aval.dtype)

    def keep_residuals(bufs, j, x, data_mb, at):
        """Run stage j's parts with their VJPs, storing each part's residuals from rows `at`."""
        for q in range(prog.parts[j]):
            params_jq = prog.params(j, q)(prepared)
            x, vjp_fn = _vjp_of(prog, j, q, params_jq, x, data_mb)
            bufs = store(bufs, "res", j, q, _stored(vjp_fn, params_jq), at)
        return bufs, x

    # A branch: (state, r) -> (state, activation sent, gradient sent). state = (the pools, the
    # receive buffers, the split backward's middle gradient, the accumulator, the loss); r = the
    # tick's row. The branch reads all from the state: the receive buffers read outside the
    # switch cost GPipe on GPT-2 1.5B (h100:16) 246.0 -> 261.3 ms.
    # take(state, r, j, q, read, write) -> (the pools, the rows part q of stage j reads `read`
    # ("res", "stash" or None) at, x, g, the micro-batch's data, the rows it writes `write` at).
    def take(state, r, j, q, read, write):
        bufs, act_buf, grad_buf = state[:3]
        return (bufs, lay.starts(read, j, q, r[SLOT_IN]) if read else None,
                act_buf[r[ACT_READ]], grad_buf[r[GRAD_READ]], data_M[r[MB]],
                lay.starts(write, j, 0, r[SLOT_OUT]) if write else None)

    def forward_branch(j, stash_only):
        def go(state, r):
            bufs, act_buf, grad_buf, mid, acc, loss = state
            _, _, x_in, _, data_mb, at_wr = take(state, r, j, 0, None,
                                                 "stash" if stash_only else "res")
            x = None if j == 0 else x_in
            if stash_only:
                out = x
                for q in range(prog.parts[j]):
                    out = prog.forward(j, q)(prog.params(j, q)(prepared), out, data_mb)
                bufs = store(bufs, "stash", j, 0, [] if j == 0 else [x], at_wr)
            else:
                bufs, out = keep_residuals(bufs, j, x, data_mb, at_wr)
            loss, send = finish(j, out, loss)
            return (bufs, act_buf, grad_buf, mid, acc, loss), send, no_send
        return go

    def recompute_branch(j):
        def go(state, r):
            bufs, act_buf, grad_buf, mid, acc, loss = state
            reads, at_rd, _, _, data_mb, at_wr = take(state, r, j, 0, "stash", "res")
            x = None if j == 0 else load(reads, "stash", j, 0, stash_layout[j], at_rd)[0]
            bufs, _ = keep_residuals(bufs, j, x, data_mb, at_wr)
            return (bufs, act_buf, grad_buf, mid, acc, loss), no_send, no_send
        return go

    def backward_branch(j, part):
        k = prog.parts[j]
        q = k - 1 - part  # the backward runs the stage's parts top down

        def go(state, r):
            bufs, act_buf, grad_buf, mid, acc, loss = state
            reads, at_rd, _, g_in, data_mb, _ = take(state, r, j, q, "res", None)
            params_jq = prog.params(j, q)(prepared)
            # A fresh trace gives the VJP's structure and its parameter leaves; its forward is
            # dead code (every other residual comes from the pool) and XLA removes it.
            out0, fresh = _vjp_of(prog, j, q, params_jq, _part_input(prog, j, q), data_mb)
            leaves, is_param, tree = _split_residuals(fresh, params_jq)
            stored = iter(load(reads, "res", j, q, layouts[(j, q)], at_rd))
            vjp_fn = jax.tree.unflatten(tree, [leaf if ip else next(stored)
                                               for leaf, ip in zip(leaves, is_param,
                                                                   strict=True)])
            if part > 0:
                ct = mid
            elif j == V - 1 and prog.head is None:
                ct = jnp.ones((), jnp.float32)
            else:
                ct = g_in
            grads = vjp_fn(ct.astype(out0.dtype))
            acc = prog.add_grads(j, q)(acc, grads[0])
            send = no_send
            if q > 0:
                mid = grads[1].astype(act_aval.dtype)
            elif j > 0:
                send = grads[1].astype(act_aval.dtype)
            return (bufs, act_buf, grad_buf, mid, acc, loss), no_send, send
        return go

    def idle(state, r):
        return state, no_send, no_send

    branches = [idle]
    for kind, j in p.branches[1:]:
        if kind.startswith("B"):
            branches.append(backward_branch(j, int(kind[1:] or 0)))
        else:
            branches.append(forward_branch(j, kind == "FS") if kind in ("F", "FS")
                            else recompute_branch(j))

    shift_act = [(d, d + 1) for d in range(S - 1)]
    shift_grad = [(d + 1, d) for d in range(S - 1)]

    def move(send, shift, wrap_pair, wrap_dst):
        got = jax.lax.ppermute(send, stage_axis, shift) if shift else send
        if p.wraps:
            wrapped = jax.lax.ppermute(send, stage_axis, [wrap_pair])
            got = jnp.where(s == wrap_dst, wrapped, got)
        return got

    # Each lane of a tick (one unfused; a stage's run of actions, one a lane, in a fused table)
    # switches over every branch: with each lane's switch over the kinds it runs alone, XLA's
    # layout assignment gave the pools the layout the backward reads and every backward
    # transposed whole pools (GPT-2 1.5B, h100:16, 4 layers a stage: B 1.75 -> 2.25 ms). A
    # stage sends up to K activations and K gradients a tick (`TickTable.sends`; a fused tick
    # may run two forwards), the k-th from the k-th lane whose branch makes one (a fused table
    # never splits a backward, so its B sends); one permute each way moves all K.
    K = p.table.sends
    sends_act = jnp.asarray([kind in ("F", "FS") and j < V - 1 for kind, j in p.branches])
    sends_grad = jnp.asarray([kind == "B" and j > 0 for kind, j in p.branches])

    def pick(outs, count, made, value):
        """Put `value` in slot `count` of `outs` when this lane `made` one."""
        return [jnp.where(made & (count == k), value, out) for k, out in enumerate(outs)]

    head_params = prog.head.params(prepared) if prog.head else None

    def head_phase(carry, h_last, rows):
        """The head of the micro-batch the last stage's forward finished this tick, on every
        stage (`HeadProgram`: each its share): the loss, the head's gradient, and the gradient
        of its input into the last stage's receive buffer. A conditional on a value the same
        on every device (device 0's row), so every device runs its collectives or none does.
        Only what it writes goes through it (the pools never do)."""
        pools_, act_buf, grad_buf, mid, acc, loss = carry
        mb = rows[0][HEAD_MB]
        keys = prog.head.keys

        def go(state):
            grad_buf, acc_h, loss = state
            x = jnp.where(s == S - 1, h_last, jnp.zeros_like(h_last))
            value, vjp_fn = jax.vjp(lambda hp, xx: prog.head.loss(hp, xx, data_M[mb]),
                                    head_params, x)
            d_hp, d_x = vjp_fn(jnp.ones_like(value))
            grad_buf = jax.lax.dynamic_update_index_in_dim(
                grad_buf, d_x.astype(act_aval.dtype), rows[s][HEAD_STORE], 0)
            return grad_buf, prog.head.add_grads(acc_h, d_hp), loss + value.astype(jnp.float32)

        grad_buf, acc_h, loss = jax.lax.cond(mb >= 0, go, lambda state: state,
                                             (grad_buf, {k: acc[k] for k in keys}, loss))
        return pools_, act_buf, grad_buf, mid, {**acc, **acc_h}, loss

    # A split head's inputs: the k-th forward of the last virtual stage a tick feeds the k-th
    # head phase after it (`lowering.plan` puts its row at L-1-k).
    H = p.heads
    makes_head = jnp.asarray([kind in ("F", "FS") and j == V - 1 for kind, j in p.branches])

    def tick(carry, rows_t):
        out_act, out_grad = [no_send] * K, [no_send] * K
        head_in = [no_send] * H
        n_act = n_grad = n_head = jnp.zeros((), jnp.int32)
        for lane in range(p.lanes):
            b = rows_t[lane][s][BRANCH]
            carry, send_act, send_grad = jax.lax.switch(b, branches, carry, rows_t[lane][s])
            if p.lanes == 1:
                out_act, out_grad, head_in = [send_act], [send_grad], [send_act] * H
            else:
                out_act = pick(out_act, n_act, sends_act[b], send_act)
                out_grad = pick(out_grad, n_grad, sends_grad[b], send_grad)
                head_in = pick(head_in, n_head, makes_head[b], send_act)
                n_act, n_grad = n_act + sends_act[b], n_grad + sends_grad[b]
                n_head = n_head + makes_head[b]
        for k in range(H):
            carry = head_phase(carry, head_in[k], rows_t[-1 - k])
        pools_, act_buf, grad_buf, mid, acc, loss = carry
        got_act = move(jnp.stack(out_act) if K > 1 else out_act[0], shift_act, (S - 1, 0), 0)
        got_grad = move(jnp.stack(out_grad) if K > 1 else out_grad[0], shift_grad,
                        (0, S - 1), S - 1)
        for k in range(K):  # the k-th arrival is stored at row L-1-k's slot (`lowering.plan`)
            r = rows_t[-1 - k][s]
            act_buf = jax.lax.dynamic_update_index_in_dim(
                act_buf, got_act[k] if K > 1 else got_act, r[ACT_STORE], 0)
            grad_buf = jax.lax.dynamic_update_index_in_dim(
                grad_buf, got_grad[k] if K > 1 else got_grad, r[GRAD_STORE], 0)
        return (pools_, act_buf, grad_buf, mid, acc, loss), None

    acc0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), local_params)
    act_buf = empty((p.act_slots + 1, *act_aval.shape), act_aval.dtype)
    grad_buf = empty((p.grad_slots + 1, *act_aval.shape), act_aval.dtype)
    # The gradient between the parts of a split backward (empty when no backward is split).
    mid = empty(act_aval.shape if split else (0,), act_aval.dtype)
    carry = (pools, act_buf, grad_buf, mid, acc0, jnp.zeros((), jnp.float32))
    carry, _ = jax.lax.scan(tick, carry, jnp.asarray(p.lane_rows()))
    return carry[5], carry[4]
