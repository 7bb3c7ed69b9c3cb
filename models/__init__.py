"""Flax NNX decoder-only transformers (GPT-2 and LLaMA styles) with logically named parameters."""

from models.config import ModelConfig
from models.presets import PRESETS, get_preset
from models.transformer import Transformer, cross_entropy

__all__ = ["PRESETS", "ModelConfig", "Transformer", "cross_entropy", "get_preset"]
