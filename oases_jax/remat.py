"""Remat policies, and the names of the activations they may save.

Models tag activations with `jax.ad_checkpoint.checkpoint_name` using the names below; a policy
keeps some of them so that recomputing a layer issues no tensor-parallel communication.
"""

from __future__ import annotations

import jax

# `*_in` are the normalised inputs of the column projections (after any all-gather), `*_out`
# the outputs of the row projections (after the all-reduce / reduce-scatter).
SAVE_NAMES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
# Where a column projection does its own gather (rings, primepar), its outputs are the
# post-collective values to keep.
COLUMN_OUT_NAMES = ("attn_qkv", "mlp_hidden")
POLICIES = ("none", "full", "save_proj", "save_dots")


def policy(name: str, gathers_in_column: bool = False):
    """The `jax.checkpoint` policy for a remat name (None: no remat). `save_proj` keeps the
    values on both sides of every tensor-parallel collective; with projections that gather
    inside the column projection (`gathers_in_column`), those include its outputs."""
    policies = jax.checkpoint_policies
    saved = SAVE_NAMES + (COLUMN_OUT_NAMES if gathers_in_column else ())
    return {
        "none": None,
        "full": policies.nothing_saveable,
        "save_proj": policies.save_only_these_names(*saved),
        "save_dots": policies.dots_with_no_batch_dims_saveable,
    }[name]
