"""Training: data, optimizer, checkpoints, metrics and the loop (`training.train`)."""

from oases_jax.training.config import CheckpointConfig, OptimConfig, ParallelConfig, TrainConfig
from oases_jax.training.loop import TrainingDiverged, TrainResult, train

__all__ = [
    "CheckpointConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "train",
]
