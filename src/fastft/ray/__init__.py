"""fastft on a Ray cluster (``pip install 'fastft[ray]'``): ``fastft ray run``, :func:`run`,
or :class:`Trainer` (Ray Train's shape: a training function, scaling and failure settings,
a result). Node agents are Ray actors running ``fastft run`` unchanged
(:mod:`fastft.ray.agent`); the driver places them, prints their output and returns the
job's status (:mod:`fastft.ray.driver`), on decisions of :mod:`fastft.ray.plan`. See
``docs/ray.md``."""

from fastft.ray.driver import RayJobError, run
from fastft.ray.trainer import (
    FailureConfig,
    Result,
    RunConfig,
    ScalingConfig,
    Trainer,
    TrainingFailed,
)

__all__ = [
    "FailureConfig",
    "RayJobError",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "Trainer",
    "TrainingFailed",
    "run",
]
