"""Training: data, optimizer, checkpoints, metrics and the loop (`training.train`)."""

from oases_jax.training.config import (
    CheckpointConfig,
    DivergenceConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from oases_jax.training.loop import TrainingDiverged, TrainResult, train

__all__ = [
    "CheckpointConfig",
    "DivergenceConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "train",
]
