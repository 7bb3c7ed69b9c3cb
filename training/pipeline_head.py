"""The head split over the pipeline's stages by vocabulary, for the tick executor
(`--split-head on`; docs/parallelism.md, "Split head"): the last stage's forward ends at the
final hidden state, and after its tick every stage runs the final norm, its part of the logits
and the split loss, so no stage carries the head's work alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from oases_jax.errors import UserError
from oases_jax.pipeline.executor import HeadProgram
from training import pipeline_spmd
from training.pipeline_layout import STAGE, PipelineSpec, _graphdefs

__all__ = ["split_head"]


def split_head(cfg: ModelConfig, pipe: PipelineSpec, shards: int, table_key: str
               ) -> HeadProgram:
    """The head split over the stages by vocabulary (the executor runs it on every stage after
    the tick of the last stage's forward): stage s computes the logits of its 1/S of the
    vocabulary (`pipeline_spmd.vocab_part`, sliced once a step from the compute-dtype table)
    and the loss over the split vocabulary (`models.loss.split_cross_entropy`). `table_key`:
    the prepared parameters' compute-dtype head table (`pipeline_step.HEAD_TABLE`)."""
    S = pipe.stages
    if cfg.padded_vocab % (S * shards):
        raise UserError(f"--split-head on: the padded vocabulary ({cfg.padded_vocab}) does not "
                        f"split into {S} stages x {shards} blocks; use --split-head off")
    head_key = "embed" if cfg.tied else "head"
    loss_fn = pipeline_spmd.head_loss(cfg, _graphdefs(cfg)[1], True)

    def params(prepared):
        s = jax.lax.axis_index(STAGE)
        part, _ = pipeline_spmd.head_part(cfg, prepared[table_key], s, S, shards, True)
        return {"norm_f": prepared["norm_f"], "part": part}

    def loss(hp, h_BLD, pair_B2L):
        ids = pipeline_spmd.vocab_ids(cfg.padded_vocab, jax.lax.axis_index(STAGE), S, shards)
        return loss_fn(hp["norm_f"], hp["part"], ids, h_BLD, pair_B2L[:, 1])

    def add_grads(acc, g):
        # The part's float32 gradient back into the float32 table: the transpose of the slice.
        s = jax.lax.axis_index(STAGE)
        _, into_table = jax.vjp(
            lambda t: pipeline_spmd.head_part(cfg, t, s, S, shards, True)[0],
            jnp.zeros(jax.tree.leaves(acc[head_key])[0].shape, jnp.float32))
        (table,) = into_table(g["part"].astype(jnp.float32))
        acc = dict(acc)
        acc[head_key] = jax.tree.map(lambda a: a + table, acc[head_key])
        acc["norm_f"] = jax.tree.map(jnp.add, acc["norm_f"], g["norm_f"])
        return acc

    return HeadProgram(params=params, loss=loss, add_grads=add_grads)
