"""GPipe with no per-stage control flow (`--pipeline gpipe_spmd`): every device runs the same
program every tick, so collectives of any tensor-parallel schedule may sit inside the stage.

The tick executor (`oases_jax.pipeline.executor`) switches each device to its own action every
tick; a collective inside a branch must then complete among the devices of one stage, which a
collective-permute cannot (its pairs name every stage's devices, and the stages in other branches
never arrive), so the ring schedules (`collective_matmul`, `oases_cm`) and PrimePar's rotations
are refused there. This executor has no branch: for t in 0 .. M+S-2, stage s runs its layers on
micro-batch t-s (stage 0 takes the embedding of micro-batch t, the others what their
predecessor sent at t-1), the last stage keeps its outputs, and one `ppermute` over S-1 pairs
(no wrap-around edge) moves the activations on. The ticks where t-s lies outside 0..M-1 (the
(S-1)/(M+S-1) bubble) compute on zeros (whatever the stage received), so the gradients they
feed are exact zeros. The backward is the scan's own
autodiff: GPipe's order (all forwards, then all backwards), its M micro-batches in flight, and
the reverse permutes. After the loop the last stage's outputs are all-reduced over `stage`
(the others hold zeros), and every stage applies the final norm, the logits of its 1/S of the
vocabulary (`vocab_part`) and the vocabulary-split loss (`models.loss.split_cross_entropy`),
one micro-batch at a time: the head's work is spread over the stages instead of run whole on
every device (or on the last stage alone, which every lockstep tick would wait for). Where
the padded vocabulary does not split into S x (its blocks over tensor) pieces, every device
runs the whole head. The tied or shared tables' gradients are summed over `stage`.

Restrictions, each checked in `training.config._check_pipeline` and `pipeline_spec`: equal
stages (one program for all), one chunk, one remat policy (`--remat`, no per-stage ratios), one
`--schedule` for every layer. PrimePar's square and `--rules fsdp_tp` run inside the stages:
nothing here hands XLA's partitioner a gather or scatter over a doubly split operand, which it
aborts on inside a region manual over `stage` (spmd_partitioner_util.cc:498; the embedding
lookup is `oases_jax.embedding.lookup`, buffer writes are dynamic update slices, `_put`).
"""

from __future__ import annotations

import math
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from oases_jax.models.config import ModelConfig
from oases_jax.models.layers import block_fns, compute_weights
from oases_jax.models.loss import split_cross_entropy
from oases_jax.models.transformer import Transformer, cross_entropy
from oases_jax.rules import constrain, entry_axes
from oases_jax.stacks import Parallel, run_stack
from oases_jax.training.pipeline_layout import STAGE, PipelineSpec, _graphdefs, over_stages

__all__ = ["spmd_1f1b_grads", "spmd_pipeline_grads", "vocab_part",
           "vocab_shards"]


def vocab_shards(cfg: ModelConfig, parallel: Parallel, manual: set[str]) -> int:
    """Into how many contiguous blocks the rules split the head table's vocabulary dimension
    over the mesh axes left to GSPMD inside the stages (not `manual`)."""
    names = ("vocab", "embed") if cfg.tied else ("embed", "vocab")
    entry = parallel.rules.param_spec(names, parallel.mesh)[names.index("vocab")]
    return math.prod(parallel.mesh.shape[a] for a in entry_axes(entry) if a not in manual)


def vocab_part(table: jax.Array, tied: bool, s: jax.Array, stages: int, shards: int
               ) -> tuple[jax.Array, jax.Array]:
    """(stage s's 1/S of the head table, the vocabulary ids of its rows or columns). The
    vocabulary is cut into `shards` contiguous blocks (the table's own split over tensor) and
    each block into S pieces; stage s takes piece s of every block, so slicing it moves
    nothing between the devices that share a block. `table`: [V, D] when `tied` (the
    embedding), else [D, V]."""
    v_axis = 0 if tied else 1
    V = table.shape[v_axis]
    piece = V // (shards * stages)
    if tied:
        blocks = table.reshape(shards, stages, piece, table.shape[1])
        part = jax.lax.dynamic_index_in_dim(blocks, s, axis=1, keepdims=False)
        part = part.reshape(V // stages, table.shape[1])
    else:
        blocks = table.reshape(table.shape[0], shards, stages, piece)
        part = jax.lax.dynamic_index_in_dim(blocks, s, axis=2, keepdims=False)
        part = part.reshape(table.shape[0], V // stages)
    ids = (jnp.arange(shards)[:, None] * (V // shards) + s * piece
           + jnp.arange(piece)[None, :]).reshape(-1)
    return part, ids


def _head_part(cfg: ModelConfig, table, s, stages: int, shards: int, split: bool):
    """(what of the head table this stage computes logits with, the vocabulary ids of its rows
    or columns): its 1/S (`vocab_part`) when `split`, else the whole table and None."""
    if not split:
        return table, None
    return vocab_part(table[...], cfg.tied, s, stages, shards)


def _head_loss(cfg: ModelConfig, gd_norm, split: bool):
    """One micro-batch's final norm, logits and loss, `loss(norm_f, part, ids, h_BLD,
    labels_BL)`, over the vocabulary part `_head_part` gave: split over `stage`
    (`split_cross_entropy`) or whole."""
    head_key = "embed" if cfg.tied else "head"

    def loss(norm_f, part, ids, h_BLD, labels_BL):
        h_BLD = nnx.merge(gd_norm, norm_f)(h_BLD)
        if split:
            eq = "bld,vd->blv" if cfg.tied else "bld,dv->blv"
            logits = constrain(jnp.einsum(eq, h_BLD, part.astype(h_BLD.dtype)),
                               ("batch", None, "vocab"))
            return split_cross_entropy(logits, labels_BL, ids, cfg.vocab_size, STAGE)
        head_in = types.SimpleNamespace(cfg=cfg, **{head_key: part})
        return cross_entropy(Transformer.logits(head_in, h_BLD, None), labels_BL,
                             cfg.vocab_size)
    return loss


class _Setup(NamedTuple):
    """What both SPMD executors derive from the model and the pipeline once."""

    S: int
    M: int
    fns: object  # the blocks' layer functions (`block_fns`)
    dt: jnp.dtype  # the compute dtype
    head_key: str  # the head's table: the embedding when tied
    shards: int  # the table's vocabulary blocks over the auto axes (`vocab_shards`)
    split: bool  # the head's vocabulary split over `stage`
    head_loss: object  # `_head_loss`


def _setup(cfg: ModelConfig, pipe: PipelineSpec, parallel: Parallel, groups: int) -> _Setup:
    S = pipe.stages
    gd_blocks, gd_norm, _ = _graphdefs(cfg)
    shards = vocab_shards(cfg, parallel, {STAGE} | ({"data"} if groups > 1 else set()))
    split = S > 1 and cfg.padded_vocab % (S * shards) == 0
    return _Setup(S, pipe.microbatches, block_fns(gd_blocks), jnp.dtype(cfg.dtype),
                  "embed" if cfg.tied else "head", shards, split,
                  _head_loss(cfg, gd_norm, split))


def _embed_all(cfg: ModelConfig, tables: dict, tokens_M2BL: jax.Array) -> jax.Array:
    """Every micro-batch's embedding, [M, B, L, D], from `tables` (`embed`, and `pos` where
    the model has it), embedded as M x B rows: under vmap the sharding constraint inside would
    leave the M axis unconstrained, which a region with no auto axis (stage=8) refuses."""
    stand_in = types.SimpleNamespace(cfg=cfg, **tables)
    ids = tokens_M2BL[:, :, 0]
    x = Transformer.embed_tokens(stand_in, ids.reshape(-1, ids.shape[-1]))
    return x.reshape(*ids.shape, -1)


def _put(buf_MX: jax.Array, i: jax.Array, keep: jax.Array, x: jax.Array) -> jax.Array:
    """`buf_MX` with row i set to x where `keep` (kept as it was elsewhere): a dynamic update
    slice, not the scatter `.at[i].set` lowers to, which XLA's partitioner aborts on inside the
    stage loop when the rows are split over two axes (PrimePar's batch over data and tp_row)."""
    row = jax.lax.dynamic_index_in_dim(buf_MX, i, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf_MX, jnp.where(keep, x, row), i, 0)


def _embedding_tables(local: dict) -> dict:
    return {k: local[k] for k in ("embed", "pos") if k in local}


def spmd_pipeline_grads(cfg: ModelConfig, pipe: PipelineSpec, parallel: Parallel,
                        params, batch_MBL, groups: int, *, poison: bool = False):
    """(mean loss, mean gradients) of a batch of M micro-batches in the stage layout, the
    stages run in lockstep without control flow (module docstring). `poison` starts the
    received activation and the output buffer as NaN: a correct step never reads them."""
    S, M, fns, dt, head_key, shards, split, head_loss = _setup(cfg, pipe, parallel, groups)
    shift = [(i, i + 1) for i in range(S - 1)]

    def loss_sum(local, tokens_M2BL, s):
        """(the loss summed over micro-batches that seeds this stage's gradient, the loss this
        stage reports: the last stage's, 0 on the others)."""
        blocks = jax.tree.map(lambda a: a[0], local["blocks"])  # this device's one chunk
        blocks = compute_weights(blocks, dt)  # once per step, outside the tick loop
        inputs = _embed_all(cfg, _embedding_tables(local), tokens_M2BL)

        def tick(carry, t):
            recv, outs = carry
            x = jnp.where(s == 0, inputs[jnp.minimum(t, M - 1)], recv)
            # A bubble tick (micro-batch t-s outside 0..M-1) runs on zeros whatever its input
            # holds (NaN under `poison`), so nothing it computes reaches a gradient.
            x = jnp.where((t >= s) & (t - s < M), x, jnp.zeros_like(x))
            y = run_stack(fns, blocks, x, scan=cfg.scan_layers, remat_default=cfg.remat)
            m = t - (S - 1)
            keep = (s == S - 1) & (m >= 0)
            outs = _put(outs, jnp.clip(m, 0, M - 1), keep, y)
            recv = jax.lax.ppermute(y, STAGE, shift) if S > 1 else y
            return (recv, outs), None

        fill = jnp.full_like(inputs, jnp.nan if poison else 0.0)
        (_, outs), _ = jax.lax.scan(tick, (fill[0], fill), jnp.arange(M + S - 1))
        # Only the last stage's outputs are the model's; the others' (never written) are zeros.
        outs = jnp.where(s == S - 1, outs, jnp.zeros_like(outs))
        # Split, every stage takes the last stage's outputs (an all-reduce over `stage` whose
        # backward sums the stages' gradients of them into the last stage's) and computes the
        # logits and loss of its 1/S of the vocabulary, sliced once here.
        if split:
            outs = jax.lax.psum(outs, STAGE)
        part, ids = _head_part(cfg, compute_weights(local[head_key], dt, lead=0), s, S, shards,
                               split)

        @jax.checkpoint
        def one(h_BLD, labels_BL):
            return head_loss(local["norm_f"], part, ids, h_BLD, labels_BL)

        def head(total, m):
            return total + one(outs[m], tokens_M2BL[m, :, 1]), None

        total, _ = jax.lax.scan(head, jnp.zeros((), jnp.float32), jnp.arange(M))
        # One stage reports the loss (`over_stages` sums it over `stage`). Split, every stage
        # holds it and seeds its gradient: each stage's loss backward is its own slice's.
        # Otherwise the other stages ran the head on zeros, and their loss seeds nothing.
        reported = jnp.where(s == S - 1, total, 0.0)
        return (total if split else reported), reported

    def stage_grads(local, tokens_M2BL):
        (_, reported), grads = jax.value_and_grad(loss_sum, has_aux=True)(
            local, tokens_M2BL, jax.lax.axis_index(STAGE))
        return reported, grads

    return over_stages(parallel, params, batch_MBL, groups, stage_grads)


def spmd_1f1b_grads(cfg: ModelConfig, pipe: PipelineSpec, parallel: Parallel,
                    params, batch_MBL, groups: int, *, poison: bool = False):
    """(mean loss, mean gradients) of M micro-batches under 1F1B with no per-stage control
    flow (`--pipeline 1f1b_spmd`). In tick t every stage s runs the forward of micro-batch
    t-s and the backward of micro-batch t-(2S-2-s), each masked to zeros outside 0..M-1, so
    the last stage runs a micro-batch's forward, loss and backward in the same tick and every
    gradient reaches the stage before it one tick later. Ticks 0..S-2 hold forwards only and
    the last S-1 backwards only: three loops, each one program on every device, so any
    collective may sit inside a stage. A stage keeps the inputs of at most 2(S-1-s)+1
    micro-batches (a ring of min(M, 2S-1) slots) and recomputes its forward inside each
    backward (`jax.vjp`, under the model's `--remat`); its weight gradients accumulate in
    float32 in one buffer. Step time (S-1) F + M (F + head + F + B) + (S-1) (F + B): 1F1B's
    bubble with the whole stage recomputed. `poison` starts the received activation and
    gradient and the input slots as NaN: a correct step never reads them."""
    st = _setup(cfg, pipe, parallel, groups)

    def stage_grads(local, tokens_M2BL):
        ticks = _Ticks.of(cfg, st, local, tokens_M2BL)
        carry = ticks.run(ticks.init_carry(poison))
        grads = ticks.grads(local, carry)
        return jnp.where(ticks.last, carry["loss"], 0.0), grads

    return over_stages(parallel, params, batch_MBL, groups, stage_grads)


class _Ticks(NamedTuple):
    """One device's values that every tick of `spmd_1f1b_grads` reads, made once per step
    before the loops, and the ticks' three phases over the carry (a dict: the received
    activation and gradient, the input slots, the float32 gradient buffers, the loss)."""

    cfg: ModelConfig
    st: _Setup
    K: int  # input slots: micro-batch m's F to its B spans 2(S-1-s)+1 ticks
    s: jax.Array  # this device's stage
    last: jax.Array  # s == S - 1
    wc: object  # the chunk's weights in the compute dtype
    inputs: jax.Array  # every micro-batch's embedding, [M, B, L, D]
    embed_vjp: object  # the embedding's backward, from the gradients of `inputs`
    hp: dict  # the final norm and the head's vocabulary part
    ids: jax.Array | None  # the part's vocabulary ids (`_head_part`)
    tokens_M2BL: jax.Array

    @classmethod
    def of(cls, cfg: ModelConfig, st: _Setup, local, tokens_M2BL) -> _Ticks:
        s = jax.lax.axis_index(STAGE)
        last = s == st.S - 1
        blocks = jax.tree.map(lambda a: a[0], local["blocks"])  # this device's one chunk
        wc = compute_weights(blocks, st.dt)  # cast once; its gradient accumulates in float32
        inputs, embed_vjp = jax.vjp(lambda tables: _embed_all(cfg, tables, tokens_M2BL),
                                    _embedding_tables(local))
        # The head's vocabulary part, sliced once (its gradient accumulates over the ticks in
        # float32 at the part's size and goes back into the table once, after the loops).
        part, ids = _head_part(cfg, compute_weights(local[st.head_key], st.dt, lead=0), s,
                               st.S, st.shards, st.split)
        hp = {"norm_f": local["norm_f"], "part": part}
        return cls(cfg, st, min(st.M, 2 * st.S - 1), s, last, wc, inputs, embed_vjp, hp, ids,
                   tokens_M2BL)

    def valid(self, m):
        return (m >= 0) & (m < self.st.M)

    def stage_fn(self, w, x):
        return run_stack(self.st.fns, w, x, scan=self.cfg.scan_layers,
                         remat_default=self.cfg.remat)

    def send(self, x, up: bool):
        S = self.st.S
        if S == 1:
            return x
        pairs = [(i, i + 1) for i in range(S - 1)] if up else [(i + 1, i) for i in range(S - 1)]
        return jax.lax.ppermute(x, STAGE, pairs)

    def init_carry(self, poison: bool) -> dict:
        x0 = self.inputs[0]
        fill = jnp.nan if poison else 0.0
        return {
            "recv_f": jnp.full_like(x0, fill), "recv_b": jnp.full_like(x0, fill),
            "slots": jnp.full((self.K, *x0.shape), fill, x0.dtype),
            "acc_w": jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), self.wc),
            "acc_head": jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), self.hp),
            "d_inputs": jnp.zeros_like(self.inputs), "loss": jnp.zeros((), jnp.float32),
        }

    def forward(self, carry, t):
        """The forward of micro-batch t-s, its input kept in its slot for the backward."""
        s, M = self.s, self.st.M
        m = t - s
        x = jnp.where(s == 0, self.inputs[jnp.clip(m, 0, M - 1)], carry["recv_f"])
        x = jnp.where(self.valid(m), x, jnp.zeros_like(x))
        slot = jnp.mod(m, self.K)
        carry["slots"] = _put(carry["slots"], slot, self.valid(m), x)
        return carry, self.stage_fn(self.wc, x)

    def head(self, carry, t, y):
        """The loss of micro-batch t-(S-1), which the last stage finished this tick, and the
        gradient of its output: every stage's share of the vocabulary (split) or the last
        stage's head alone."""
        S, M, split, last = self.st.S, self.st.M, self.st.split, self.last
        m = t - (S - 1)
        h = jnp.where(last, y, jnp.zeros_like(y))
        if split:
            h = jax.lax.psum(h, STAGE)
        labels = self.tokens_M2BL[jnp.clip(m, 0, M - 1), :, 1]
        loss, head_vjp = jax.vjp(
            lambda p, h: self.st.head_loss(p["norm_f"], p["part"], self.ids, h, labels),
            self.hp, h)
        seed = jnp.where(self.valid(m) & (last | split), 1.0, 0.0).astype(loss.dtype)
        d_hp, d_h = head_vjp(seed)
        if split:
            d_h = jax.lax.psum(d_h, STAGE)
        carry["acc_head"] = jax.tree.map(lambda a, d: a + d.astype(jnp.float32),
                                         carry["acc_head"], d_hp)
        carry["loss"] = carry["loss"] + jnp.where(self.valid(m) & last, loss, 0.0)
        return carry, d_h

    def backward(self, carry, t, d_h):
        """The backward of micro-batch t-(2S-2-s), its forward recomputed from its slot;
        `d_h` is the head's gradient (None where no head ran this tick)."""
        s, M = self.s, self.st.M
        m = t - (2 * self.st.S - 2 - s)
        x = carry["slots"][jnp.mod(m, self.K)]
        x = jnp.where(self.valid(m), x, jnp.zeros_like(x))
        g = carry["recv_b"] if d_h is None else jnp.where(self.last, d_h, carry["recv_b"])
        g = jnp.where(self.valid(m), g, jnp.zeros_like(g))
        _, stage_vjp = jax.vjp(self.stage_fn, self.wc, x)
        d_w, d_x = stage_vjp(g.astype(x.dtype))
        carry["acc_w"] = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), carry["acc_w"],
                                      d_w)
        keep = self.valid(m) & (s == 0)
        mm = jnp.clip(m, 0, M - 1)
        carry["d_inputs"] = _put(carry["d_inputs"], mm, keep, d_x)
        carry["recv_b"] = self.send(d_x, up=False)
        return carry

    def run(self, carry: dict) -> dict:
        """The three loops: forwards only (warm), a forward, the head and a backward
        (steady), backwards only (cool)."""
        S, M = self.st.S, self.st.M

        def warm(carry, t):
            carry, y = self.forward(carry, t)
            carry["recv_f"] = self.send(y, up=True)
            return carry, None

        def steady(carry, t):
            carry, y = self.forward(carry, t)
            carry, d_h = self.head(carry, t, y)
            carry = self.backward(carry, t, d_h)
            carry["recv_f"] = self.send(y, up=True)
            return carry, None

        def cool(carry, t):
            return self.backward(carry, t, None), None

        for body, start, stop in ((warm, 0, S - 1), (steady, S - 1, M + S - 1),
                                  (cool, M + S - 1, M + 2 * S - 2)):
            if stop > start:
                carry, _ = jax.lax.scan(body, carry, jnp.arange(start, stop))
        return carry

    def grads(self, local, carry: dict) -> dict:
        """The gradients of `local` from the loops' buffers, in its dtypes."""
        cfg, st = self.cfg, self.st
        # Stage 0's input gradients are the embedding's; elsewhere they are zeros.
        (d_emb,) = self.embed_vjp(carry["d_inputs"])
        grads = {k: jax.tree.map(jnp.zeros_like, v) for k, v in local.items()}
        grads["blocks"] = jax.tree.map(lambda a, p: a.astype(p.dtype)[None], carry["acc_w"],
                                       local["blocks"])
        grads.update(d_emb)
        grads["norm_f"] = jax.tree.map(lambda a, p: a.astype(p.dtype),
                                       carry["acc_head"]["norm_f"], local["norm_f"])
        # The part's gradient back into the table: the transpose of the slice, in float32.
        _, into_table = jax.vjp(
            lambda t: _head_part(cfg, t, self.s, st.S, st.shards, st.split)[0],
            local[st.head_key])
        (table,) = into_table(carry["acc_head"]["part"])
        grads[st.head_key] = jax.tree.map(jnp.add, grads[st.head_key], table)
        return grads
