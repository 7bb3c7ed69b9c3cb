"""The decoder-only transformer: embeddings, a stack of blocks (scanned or unrolled), and a head.

The blocks' parameters are always stacked on a leading `layers` axis, so the parameter layout,
checkpoints and shardings do not depend on `scan_layers` or the remat policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models import gpt2, llama
from models.config import ModelConfig
from models.layers import RING_SAVE_NAMES, SAVE_NAMES, Block, param, pipelined_layers
from oases_jax import layer_plan
from oases_jax import tensor_parallel as tp
from oases_jax.rules import constrain, use_rules

FAMILY_NORM = {"gpt2": gpt2.NORM, "llama": llama.NORM}


def remat_policy(name: str, rings: bool = False):
    """The `jax.checkpoint` policy for a remat name (None: no remat). `save_proj` keeps the
    values on both sides of every tensor-parallel collective, so recomputing a layer issues no
    communication; with ring schedules (`rings`) those include the column projections' outputs."""
    policies = jax.checkpoint_policies
    saved = SAVE_NAMES + (RING_SAVE_NAMES if rings else ())
    return {
        "none": None,
        "full": policies.nothing_saveable,
        "save_proj": policies.save_only_these_names(*saved),
        "save_dots": policies.dots_with_no_batch_dims_saveable,
    }[name]


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        norm_cls = FAMILY_NORM[cfg.family]
        d, vp = cfg.d_model, cfg.padded_vocab
        self.embed = param(rngs, (vp, d), ("vocab", "embed"), std=0.02)
        if cfg.learned_positions:
            self.pos = param(rngs, (cfg.max_seq_len, d), ("pos", "embed"), std=0.01)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, norm_cls, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.norm_f = norm_cls(cfg, rngs=rngs)
        if not cfg.tied:
            self.head = param(rngs, (d, vp), ("embed", "vocab"), std=0.02)

    def embed_tokens(self, tokens_BL: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.cfg.dtype)
        x_BLD = jnp.take(self.embed[...], tokens_BL, axis=0).astype(dt)
        if self.cfg.learned_positions:
            x_BLD = x_BLD + self.pos[: tokens_BL.shape[1]].astype(dt)
        return constrain(x_BLD, ("batch", "seq", "embed"))

    def backbone(self, x_BLD: jax.Array) -> jax.Array:
        """All blocks and the final norm. Under a per-layer plan (`oases_jax.layer_plan`) each
        run of equal layers is its own scan, under its own schedule, rules and remat policy."""
        graphdef, stacked = nnx.split(self.blocks)
        plan, ctx = layer_plan.active(), tp.active()
        if plan is None or ctx is None:
            x_BLD = self._layers(graphdef, stacked, x_BLD, self.cfg.remat)
            return self.norm_f(x_BLD)
        if len(plan) != self.cfg.n_layers:
            raise ValueError(f"plan has {len(plan)} layers, model {self.cfg.n_layers}")
        for start, end, spec in layer_plan.segments(plan):
            seg_rules = layer_plan.rules_for(spec.schedule, ctx.rules)
            seg_tp = dataclasses.replace(ctx, schedule=spec.schedule, rules=seg_rules,
                                         sub_batches=spec.sub_batches)
            part = jax.tree.map(lambda a, s=start, e=end: a[s:e], stacked)
            with use_rules(seg_rules, ctx.mesh), tp.use_tensor_parallel(seg_tp):
                x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))
                x_BLD = self._layers(graphdef, part, x_BLD, spec.remat)
            x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))
        return self.norm_f(x_BLD)

    def _layers(self, graphdef, stacked, x_BLD: jax.Array, remat: str) -> jax.Array:
        def layer(x_BLD, layer_state):
            return nnx.merge(graphdef, layer_state)(x_BLD), None

        policy = remat_policy(remat, tp.uses_rings())

        def wrap(f, in_scan: bool):
            if remat == "none":
                return f
            return jax.checkpoint(f, policy=policy, prevent_cse=not in_scan)

        ctx = tp.active()
        if ctx is not None and ctx.pipelined_stack:
            return pipelined_layers(graphdef, stacked, x_BLD, ctx, wrap, self.cfg.scan_layers)
        layer = wrap(layer, self.cfg.scan_layers)
        if self.cfg.scan_layers:
            x_BLD, _ = jax.lax.scan(layer, x_BLD, stacked)
        else:
            n = jax.tree.leaves(stacked)[0].shape[0]
            for i in range(n):
                x_BLD, _ = layer(x_BLD, jax.tree.map(lambda a, i=i: a[i], stacked))
        return x_BLD

    def logits(self, h_BLD: jax.Array) -> jax.Array:
        """Logits over the padded vocabulary, float32."""
        dt = h_BLD.dtype
        if self.cfg.tied:
            logits_BLV = jnp.einsum("bld,vd->blv", h_BLD, self.embed[...].astype(dt))
        else:
            logits_BLV = jnp.einsum("bld,dv->blv", h_BLD, self.head[...].astype(dt))
        logits_BLV = constrain(logits_BLV, ("batch", None, "vocab"))
        return logits_BLV.astype(jnp.float32)

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        return self.logits(self.backbone(self.embed_tokens(tokens_BL)))


def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array, vocab_size: int) -> jax.Array:
    """Mean next-token cross-entropy; padded vocabulary rows are masked out of the softmax."""
    valid_V = jnp.arange(logits_BLV.shape[-1]) < vocab_size
    logits_BLV = jnp.where(valid_V, logits_BLV, jnp.finfo(jnp.float32).min)
    logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return jnp.mean(logz_BL - target_logit_BL)
