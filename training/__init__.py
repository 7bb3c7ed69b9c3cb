"""Training: data, optimizer, checkpoints, metrics and the loop (`training.train`)."""

from training.config import CheckpointConfig, OptimConfig, ParallelConfig, TrainConfig
from training.loop import TrainingDiverged, TrainResult, train

__all__ = [
    "CheckpointConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "train",
]
