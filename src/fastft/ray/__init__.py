"""fastft on a Ray cluster (``pip install 'fastft[ray]'``): ``fastft ray run``, :func:`run`,
or :class:`Trainer` (Ray Train's shape and spellings: a training function, scaling,
failure and checkpoint settings, ``train.report``, a result). Node agents are Ray actors running ``fastft run`` unchanged
(:mod:`fastft.ray.agent`); the driver places them, prints their output and returns the
job's status (:mod:`fastft.ray.driver`), on decisions of :mod:`fastft.ray.plan`. See
``docs/ray.md``."""

from fastft.ray import train
from fastft.ray.driver import RayJobError, run
from fastft.ray.trainer import (
    CheckpointConfig,
    FailureConfig,
    Result,
    RunConfig,
    ScalingConfig,
    TorchTrainer,
    Trainer,
    TrainingFailed,
)

__all__ = [
    "CheckpointConfig",
    "FailureConfig",
    "RayJobError",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TorchTrainer",
    "Trainer",
    "TrainingFailed",
    "run",
    "train",
]
