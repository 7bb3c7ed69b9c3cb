"""Mixture-of-experts runtime (Parm): top-k routing with fixed capacity, the MoE schedules
(ds_moe, parm_s1, parm_s2) over the expert and tensor mesh axes, their alpha-beta cost model,
and the runner of a stack of (dense..., MoE) layer groups. Pure JAX, no Flax."""

from oases_jax.moe.layer import MoEArgs, MoESetup, moe_layer, use_moe
from oases_jax.moe.schedules import CHOICES, MOE_SCHEDULES

__all__ = ["CHOICES", "MOE_SCHEDULES", "MoEArgs", "MoESetup", "moe_layer", "use_moe"]
