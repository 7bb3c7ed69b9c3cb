"""The head split over the pipeline's stages by positions, for the tick executor (`--split-head on`;
docs/parallelism.md, "Split head"): the last stage's forward ends at the final hidden state, and
after its tick every stage runs the final norm, the logits and the loss of 1/S of that
micro-batch's positions, so no stage carries the head's work alone.

Moving the hidden state is one reduce-scatter over `stage` (the last stage's state, zeros
elsewhere, each stage keeping its slice of the sequence) and, in its transpose, one all-gather
of the slices' gradients, which leaves the whole gradient on the last stage: half the bytes of
splitting the vocabulary instead (an all-reduce of the state and one of its gradient, plus the
softmax statistics'), and the head's weight stays whole on every stage, as the stage layout
keeps it (its gradient is summed over `stage` once a step with the other shared ones)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx

from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig
from oases_jax.models.transformer import Transformer, cross_entropy
from oases_jax.pipeline.executor import HeadProgram
from oases_jax.training.pipeline_layout import STAGE, PipelineSpec, _graphdefs

__all__ = ["split_head"]


def split_head(cfg: ModelConfig, pipe: PipelineSpec, seq_len: int, table_key: str
               ) -> HeadProgram:
    """The split head of a pipeline whose micro-batches hold `seq_len` positions. `table_key`:
    the prepared parameters' compute-dtype head table (`pipeline_step.HEAD_TABLE`)."""
    S = pipe.stages
    if seq_len % S:
        raise UserError(f"--split-head on splits each micro-batch's {seq_len} positions over "
                        f"{S} stages: use a --seq-len divisible by {S}, or --split-head off")
    n = seq_len // S
    head_key = "embed" if cfg.tied else "head"
    gd_norm = _graphdefs(cfg)[1]

    def params(prepared):
        return {"norm_f": prepared["norm_f"], "table": prepared[table_key]}

    def loss(hp, x_BLD, pair_B2L):
        """This stage's share of the micro-batch's loss: the mean over its positions / S."""
        h_BnD = jax.lax.psum_scatter(x_BLD, STAGE, scatter_dimension=1, tiled=True)
        start = jax.lax.axis_index(STAGE) * n
        labels_Bn = jax.lax.dynamic_slice_in_dim(pair_B2L[:, 1], start, n, axis=1)
        h_BnD = nnx.merge(gd_norm, hp["norm_f"])(h_BnD)
        head_in = types.SimpleNamespace(cfg=cfg, **{head_key: hp["table"]})
        logits = Transformer.logits(head_in, h_BnD, None)
        return cross_entropy(logits, labels_Bn, cfg.vocab_size) / S

    def add_grads(acc, g):
        acc = dict(acc)
        acc[head_key] = jax.tree.map(lambda a: a + g["table"].astype(jnp.float32),
                                     acc[head_key])
        acc["norm_f"] = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc["norm_f"],
                                     g["norm_f"])
        return acc

    return HeadProgram(params=params, loss=loss, add_grads=add_grads,
                       keys=tuple(dict.fromkeys((head_key, "norm_f"))))
