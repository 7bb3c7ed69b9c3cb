"""GPT-2 family: learned positions, LayerNorm, GELU MLP with biases, tied embeddings."""

from oases_jax.models.layers import LayerNorm

NORM = LayerNorm
