"""fastft on a Ray cluster (``pip install 'fastft[ray]'``): ``fastft ray run`` or
:func:`run`. Node agents are Ray actors running ``fastft run`` unchanged
(:mod:`fastft.ray.agent`); the driver places them, prints their output and returns the
job's status (:mod:`fastft.ray.driver`). See ``docs/ray.md``."""

from fastft.ray.driver import RayJobError, run

__all__ = ["RayJobError", "run"]
