"""The settings of a :class:`fastft.ray.Trainer`, in Ray Train's shapes and spellings.

Each takes fastft's own fields and Ray Train's (``ScalingConfig(num_workers=4,
use_gpu=True)``, ``FailureConfig(max_failures=3)``, ``RunConfig(failure_config=...,
checkpoint_config=CheckpointConfig(num_to_keep=2))``); :func:`coerce` also takes Ray
Train's own objects (``ray.train.ScalingConfig``, ...) by their fields, so that a Ray
Train script's set-up runs unchanged but for its import line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

__all__ = ["CheckpointConfig", "FailureConfig", "RunConfig", "ScalingConfig", "coerce"]

UNLIMITED = 1_000_000
"""``max_failures=-1`` (Ray Train's "retry forever") as a count of restarts."""


@dataclass(frozen=True)
class ScalingConfig:
    """How many node agents and workers, and what each node's bundle holds. Ray Train's
    ``num_workers`` (one worker a node agent unless ``workers_per_node`` says more; the
    machines may be shared), ``use_gpu`` (one GPU a worker) and ``resources_per_worker``
    (``{"CPU": 2, "GPU": 1}``) are taken too."""

    num_nodes: int = 1
    workers_per_node: int = 1
    cpus_per_node: float | None = None
    """Each bundle's CPUs (default: the workers plus one for the agent)."""
    gpus_per_node: float = 0.0
    placement: str = "strict"
    """``strict``: each node on a machine of its own; ``spread``: machines may be shared."""
    num_workers: int | None = None
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None

    def __post_init__(self) -> None:
        n = self.num_workers
        if n is None:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ScalingConfig(num_workers={n!r}): a number of workers >= 1")
        per = self.workers_per_node
        if n % per:
            raise ValueError(
                f"ScalingConfig(num_workers={n}, workers_per_node={per}): the workers must "
                "fill whole nodes; give num_workers a multiple of workers_per_node"
            )
        res = dict(self.resources_per_worker or {})
        gpus = float(res.get("GPU", 1.0 if self.use_gpu else 0.0))
        cpus = res.get("CPU")
        set_ = object.__setattr__
        set_(self, "num_nodes", n // per)
        set_(self, "gpus_per_node", gpus * per)
        if cpus is not None and self.cpus_per_node is None:
            set_(self, "cpus_per_node", float(cpus) * per + 1)  # (and the agent)
        set_(self, "placement", "spread")  # (Ray Train packs workers onto machines)

    @property
    def total_workers(self) -> int:
        return self.num_nodes * self.workers_per_node


@dataclass(frozen=True)
class FailureConfig:
    max_node_restarts: int = 3
    """How many times a node's agent actor may be replaced (by its standby or a new one)."""
    standby_agents: bool = True
    """A warm standby agent per node (``fastft ray run --no-standby-agents``: none)."""
    max_worker_restarts: int | None = None
    """``fastft run --max-restarts``: restarts of one worker (None: fastft's default)."""
    max_failures: int | None = None
    """Ray Train's: how many failures the run survives (-1: any number); sets both the
    workers' restarts and the nodes' replacements where those are not given."""

    def __post_init__(self) -> None:
        m = self.max_failures
        if m is None:
            return
        if isinstance(m, bool) or not isinstance(m, int) or m < -1:
            raise ValueError(f"FailureConfig(max_failures={m!r}): -1 (any number) or >= 0")
        n = UNLIMITED if m == -1 else m
        if self.max_worker_restarts is None:
            object.__setattr__(self, "max_worker_restarts", n)
        object.__setattr__(self, "max_node_restarts", n)


@dataclass(frozen=True)
class CheckpointConfig:
    """Ray Train's: how many reported checkpoints to keep (None: all), ranked by
    ``checkpoint_score_attribute`` (a reported metric; None: the newest), ``max`` or
    ``min`` first; also the durable tier's ``--checkpoint-keep``."""

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"

    def __post_init__(self) -> None:
        k = self.num_to_keep
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"CheckpointConfig(num_to_keep={k!r}): None (all) or >= 1")
        if self.checkpoint_score_order not in ("max", "min"):
            raise ValueError(
                f"CheckpointConfig(checkpoint_score_order={self.checkpoint_score_order!r}): "
                "'max' or 'min'"
            )


@dataclass(frozen=True)
class RunConfig:
    name: str | None = None
    """The job's name (default: ``ray-XXXXXX``)."""
    storage_path: str | None = None
    """Where run directories go (default ``./runs``). With a ``name`` too, the run's is
    ``STORAGE/NAME``, as Ray Train's: a fit with the same two goes on from the run there
    (its durable checkpoints; ``train.get_checkpoint()``: its newest reported one);
    without one, ``STORAGE/ray-TIME-PID``."""
    checkpoint_every: int = 0
    """Steps between fastft's durable checkpoints (0: none)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (default ``RUN_DIR/checkpoints``; shared storage across
    machines)."""
    runtime_env: dict[str, Any] | None = None
    """Ray's, for the node agents and their workers (``working_dir``, ``pip``, ...)."""
    flags: Sequence[str] = ()
    """Any other ``fastft run`` flags (``--min-replicas 2``, ``--warm-spares 1``, ...)."""
    checkpoint_config: CheckpointConfig | None = None
    """Ray Train's: the reported checkpoints kept (and the durable tier's)."""
    failure_config: FailureConfig | None = None
    """Ray Train's place for it (the trainer's ``failure_config`` wins)."""


T = TypeVar("T")


def coerce(obj: Any, cls: type[T]) -> T | None:
    """``obj`` as ``cls``: itself, None, or an object of Ray Train's own class of that name
    (``ray.train.ScalingConfig``, ...) read field by field, the fields of Ray's that
    fastft has no use for left out."""
    if obj is None or isinstance(obj, cls):
        return obj
    name = cls.__name__
    if type(obj).__name__ != name:
        raise TypeError(f"{name}: expected fastft.ray.{name} or Ray Train's, not {type(obj)!r}")
    given = {f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)}  # type: ignore[arg-type]
    for key, sub in (("checkpoint_config", CheckpointConfig), ("failure_config", FailureConfig)):
        if key in given:
            given[key] = coerce(given[key], sub)
    if name == "ScalingConfig" and given.get("num_workers") is None:
        given.pop("num_workers", None)
    if name == "RunConfig" and given.get("storage_path") is not None:
        given["storage_path"] = str(given["storage_path"])
    return cls(**{k: v for k, v in given.items() if v is not None})
