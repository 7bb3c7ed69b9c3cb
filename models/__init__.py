"""Flax NNX decoder-only transformers (GPT-2 and LLaMA styles) with logically named parameters."""

from oases_jax.models.config import ModelConfig
from oases_jax.models.presets import PRESETS, get_preset
from oases_jax.models.transformer import Transformer, cross_entropy

__all__ = ["PRESETS", "ModelConfig", "Transformer", "cross_entropy", "get_preset"]
