"""The decoder-only transformer: embeddings, a stack of blocks (scanned or unrolled), and a head.

The blocks' parameters are always stacked on a leading `layers` axis, so the parameter layout,
checkpoints and shardings do not depend on `scan_layers` or the remat policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from oases_jax.embedding import lookup
from oases_jax.models import gpt2, llama
from oases_jax.models.config import ModelConfig
from oases_jax.models.layers import Block, block_fns, compute_weights, param
from oases_jax.models.loss import cross_entropy
from oases_jax.models.moe import MoEGroup, group_fns
from oases_jax.moe.stack import run_groups
from oases_jax.rules import constrain
from oases_jax.stacks import run_stack

FAMILY_NORM = {"gpt2": gpt2.NORM, "llama": llama.NORM}


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        norm_cls = FAMILY_NORM[cfg.family]
        d, vp = cfg.d_model, cfg.padded_vocab
        self.embed = param(rngs, (vp, d), ("vocab", "embed"), std=0.02)
        if cfg.learned_positions:
            self.pos = param(rngs, (cfg.max_seq_len, d), ("pos", "embed"), std=0.01)

        # An MoE model stacks layer groups (moe_every - 1 dense blocks, one MoE block).
        unit, count = (MoEGroup, cfg.n_layers // cfg.moe_every) if cfg.moe else (Block,
                                                                                   cfg.n_layers)

        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block | MoEGroup:
            return unit(cfg, norm_cls, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.norm_f = norm_cls(cfg, rngs=rngs)
        if not cfg.tied:
            self.head = param(rngs, (d, vp), ("embed", "vocab"), std=0.02)

    @jax.named_scope("embed")
    def embed_tokens(self, tokens_BL: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.cfg.dtype)
        x_BLD = lookup(self.embed[...], tokens_BL).astype(dt)
        if self.cfg.learned_positions:
            x_BLD = x_BLD + self.pos[: tokens_BL.shape[1]].astype(dt)
        return constrain(x_BLD, ("batch", "seq", "embed"))

    def backbone(self, x_BLD: jax.Array) -> jax.Array:
        """All blocks and the final norm, run by the runtime (`oases_jax.stacks.run_stack`)
        under the active parallel setup: each segment of equal layers under its own schedule,
        rules and remat policy."""
        return self.backbone_with_losses(x_BLD)[0]

    def backbone_with_losses(self, x_BLD: jax.Array) -> tuple[jax.Array, dict]:
        """`backbone` and the MoE layers' router losses summed over layers (`models.moe.LOSSES`;
        empty for a dense model). MoE groups run through `oases_jax.moe.stack.run_groups`."""
        graphdef, stacked = nnx.split(self.blocks)
        stacked = compute_weights(stacked, x_BLD.dtype)
        if self.cfg.moe:
            x_BLD, losses = run_groups(group_fns(graphdef), stacked, x_BLD,
                                       scan=self.cfg.scan_layers, remat_default=self.cfg.remat)
        else:
            x_BLD = run_stack(block_fns(graphdef), stacked, x_BLD, scan=self.cfg.scan_layers,
                              remat_default=self.cfg.remat)
            losses = {}
        return self.norm_f(x_BLD), losses

    @jax.named_scope("loss")
    def logits(self, h_BLD: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Logits over the padded vocabulary, in `dtype` (None: the compute dtype, which is what
        `cross_entropy` takes without a float32 copy)."""
        dt = h_BLD.dtype
        if self.cfg.tied:
            logits_BLV = jnp.einsum("bld,vd->blv", h_BLD, self.embed[...].astype(dt))
        else:
            logits_BLV = jnp.einsum("bld,dv->blv", h_BLD, self.head[...].astype(dt))
        logits_BLV = constrain(logits_BLV, ("batch", None, "vocab"))
        return logits_BLV if dtype is None else logits_BLV.astype(dtype)

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        return self.forward(tokens_BL)[0]

    def forward(self, tokens_BL: jax.Array, dtype=jnp.float32) -> tuple[jax.Array, dict]:
        """(logits in `dtype` as `logits`, the MoE router losses summed over layers; {} for a
        dense model)."""
        h_BLD, losses = self.backbone_with_losses(self.embed_tokens(tokens_BL))
        return self.logits(h_BLD, dtype), losses


def objective(model: Transformer, tokens_BL: jax.Array) -> tuple[jax.Array, dict]:
    """The training loss of next-token prediction on tokens [B, L+1] and its parts: cross
    entropy, plus for an MoE model router_aux_weight * load-balancing loss + router_z_weight *
    z-loss (both summed over the MoE layers). The parts reported are the cross entropy and the
    per-MoE-layer means of the router losses and of the dropped fraction."""
    cfg = model.cfg
    logits_BLV, losses = model.forward(tokens_BL[:, :-1], dtype=None)
    ce = cross_entropy(logits_BLV, tokens_BL[:, 1:], cfg.vocab_size)
    if not losses:
        return ce, {}
    loss = ce + cfg.router_aux_weight * losses["aux_loss"] + cfg.router_z_weight * losses["z_loss"]
    n = cfg.n_moe_layers
    return loss, {"ce_loss": ce, **{k: v / n for k, v in losses.items()}}
