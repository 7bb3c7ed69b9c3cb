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
the reverse permutes. After the loop every device applies the final norm, head and loss to the
last stage's outputs (the others' are discarded: the step waits for the last stage anyway) one
micro-batch at a time; the tied or shared tables' gradients are summed over `stage`.

Restrictions, each checked in `training.config._check_pipeline` and `pipeline_spec`: equal
stages (one program for all), one chunk, one remat policy (`--remat`, no per-stage ratios), one
`--schedule` for every layer, and neither `--rules fsdp_tp` nor PrimePar: XLA's SPMD partitioner
aborts on both inside a region manual over `stage` (spmd_partitioner_util.cc:498, "Check failed:
partition_group_list.num_replica_groups() * ... == device_groups.num_devices_per_group()").
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import block_fns, compute_weights
from models.transformer import Transformer, cross_entropy
from oases_jax.stacks import Parallel, run_stack
from training.pipeline_layout import STAGE, PipelineSpec, _graphdefs, over_stages

__all__ = ["NAME", "spmd_pipeline_grads"]

NAME = "gpipe_spmd"


def spmd_pipeline_grads(cfg: ModelConfig, pipe: PipelineSpec, parallel: Parallel,
                        params, batch_MBL, groups: int, *, poison: bool = False):
    """(mean loss, mean gradients) of a batch of M micro-batches in the stage layout, the
    stages run in lockstep without control flow (module docstring). `poison` starts the
    received activation and the output buffer as NaN: a correct step never reads them."""
    S, M = pipe.stages, pipe.microbatches
    gd_blocks, gd_norm, _ = _graphdefs(cfg)
    fns = block_fns(gd_blocks)
    dt = jnp.dtype(cfg.dtype)
    head_key = "embed" if cfg.tied else "head"
    shift = [(i, i + 1) for i in range(S - 1)]

    def loss_sum(local, tokens_M2BL, s):
        """Sum over micro-batches of the loss: the last stage's; 0 on the others."""
        blocks = jax.tree.map(lambda a: a[0], local["blocks"])  # this device's one chunk
        blocks = compute_weights(blocks, dt)  # once per step, outside the tick loop
        stand_in = types.SimpleNamespace(cfg=cfg, **{k: local[k] for k in ("embed", "pos")
                                                     if k in local})
        # Every micro-batch's embedding, [M, B, L, D], embedded as M x B rows: under vmap the
        # sharding constraint inside would leave the M axis unconstrained, which a region with
        # no auto axis (stage=8) refuses.
        ids = tokens_M2BL[:, :, 0]
        inputs = Transformer.embed_tokens(stand_in, ids.reshape(-1, ids.shape[-1]))
        inputs = inputs.reshape(*ids.shape, -1)

        def tick(carry, t):
            recv, outs = carry
            x = jnp.where(s == 0, inputs[jnp.minimum(t, M - 1)], recv)
            # A bubble tick (micro-batch t-s outside 0..M-1) runs on zeros whatever its input
            # holds (NaN under `poison`), so nothing it computes reaches a gradient.
            x = jnp.where((t >= s) & (t - s < M), x, jnp.zeros_like(x))
            y = run_stack(fns, blocks, x, scan=cfg.scan_layers, remat_default=cfg.remat)
            m = t - (S - 1)
            keep = (s == S - 1) & (m >= 0)
            outs = outs.at[jnp.clip(m, 0, M - 1)].set(
                jnp.where(keep, y, outs[jnp.clip(m, 0, M - 1)]))
            recv = jax.lax.ppermute(y, STAGE, shift) if S > 1 else y
            return (recv, outs), None

        fill = jnp.full_like(inputs, jnp.nan if poison else 0.0)
        (_, outs), _ = jax.lax.scan(tick, (fill[0], fill), jnp.arange(M + S - 1))
        # Only the last stage's outputs are the model's; the others' (never written) are zeros.
        outs = jnp.where(s == S - 1, outs, jnp.zeros_like(outs))
        norm = nnx.merge(gd_norm, local["norm_f"])
        head_in = types.SimpleNamespace(cfg=cfg, **{head_key: compute_weights(
            local[head_key], dt, lead=0)})

        @jax.checkpoint
        def one(h_BLD, labels_BL):
            logits = Transformer.logits(head_in, norm(h_BLD), None)
            return cross_entropy(logits, labels_BL, cfg.vocab_size)

        def head(total, m):
            return total + one(outs[m], tokens_M2BL[m, :, 1]), None

        total, _ = jax.lax.scan(head, jnp.zeros((), jnp.float32), jnp.arange(M))
        # Elsewhere the head ran on zeros, and its loss must feed no gradient.
        return jnp.where(s == S - 1, total, 0.0)

    def stage_grads(local, tokens_M2BL):
        return jax.value_and_grad(loss_sum)(local, tokens_M2BL, jax.lax.axis_index(STAGE))

    return over_stages(parallel, params, batch_MBL, groups, stage_grads)
