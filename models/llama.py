"""LLaMA family: RoPE, RMSNorm, SwiGLU MLP without biases, grouped-query attention, untied head."""

from oases_jax.models.layers import RMSNorm

NORM = RMSNorm
