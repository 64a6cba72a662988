"""Contract of the worker runtime: its configuration, epoch views and errors.

The launcher (``fastft run``) hands a worker its configuration through the environment
(:class:`fastft.process.env.WorkerEnv`, read by :meth:`RuntimeConfig.from_env`); tests
build it directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastft.errors import ConfigError
from fastft.process.env import (
    BETWEEN_STEPS_TIMEOUT_S,
    DRAIN_GRACE_S,
    HANG_TIMEOUT_S,
    HEALTH_HOST_MB,
    MAX_RECOVERIES,
    WORKER_FIELD_TYPES,
    WorkerEnv,
)
from fastft.protocol.exits import (
    EXIT_STATE_LOST,
)
from fastft.runtime.checks import (
    CHECKPOINT_INTERVAL_S,
    check_checkpoints,
    check_decide,
    check_shard_groups,
    check_stage,
    check_sync,
)
from fastft.runtime.view import EpochView, Member

__all__ = [
    "EXIT_STATE_LOST",
    "REGROUP_TIMEOUT_S",
    "EpochView",
    "HealthCheck",
    "Member",
    "RuntimeConfig",
    "choose_backend",
]

HealthCheck = Callable[[], Any]
"""A user's health check (:meth:`fastft.Runtime.add_health_check`, :mod:`.health`)."""

REGROUP_TIMEOUT_S = 5.0
"""After every worker was lost, how long the next epoch waits for every slot before an
elastic world closes it with at least ``min_replicas`` (:attr:`RuntimeConfig.regroup_timeout_s`)."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything one worker needs to know about its job.

    ``rank``: this worker's slot (0 .. world_size-1), stable across restarts;
    ``world_size``: number of slots; ``min_replicas``: fewest members an epoch may have
    (survivors wait for restarted workers below it; ``world_size`` keeps the world fixed);
    ``life``: how many times this slot was started before (the fault plan uses it);
    ``rollback_timeout_s``: how long a rollback barrier waits for a silent member before
    declaring it dead (hangs are normally caught sooner by the agent);
    ``start_timeout_s``: how long the first epoch waits for every slot;
    ``regroup_timeout_s``: after every worker was lost, how long the next epoch waits for
    every slot before an elastic world closes it with at least ``min_replicas`` (the others
    join at a later step: a slot may be gone for good, or its restart lost again);
    ``pg_timeout_s``: the data plane's own timeout (a backstop: faults interrupt sooner);
    ``max_step_retries``: consecutive local exceptions at one step before the exception
    is re-raised (a deterministic bug must not loop forever);
    ``backend``: ``gloo`` or ``nccl`` (``auto``: nccl when CUDA is available);
    ``relay_socket``: the node's bus relay (``fastft run`` sets it, :mod:`fastft.bus.relay`):
    the worker hears the bus from its agent instead of subscribing to the store;
    ``incarnation``: chosen by the agent (so it can name the process when it dies),
    random when None; ``check_every``: log the state digest (S3) every N commits (0: never);
    ``compare_every``: the in-band replica check every N steps (0: off;
    :mod:`fastft.runtime.state.compare`); ``buffers``: ``average`` the model's floating
    buffers over the members with each step's gradients, or keep each member's ``local``;
    ``decide``: how a fault-free step is decided, ``collective`` (the vote rides the
    gradients' allreduce, :mod:`fastft.runtime.state.inband`, or an allreduce of its own after
    them; the store only when a drain or a join is in flight), ``store`` (every member
    votes in the store) or ``auto``, the cheaper of the two
    (:func:`fastft.runtime.checks.by_collective`; docs/architecture.md);
    ``node_silence_ms``: several nodes (``fastft run`` sets it): the shortest silence after
    which a node may be declared lost; a Gloo step decided by its collective this long
    after the member's previous commit confirms the commit in the store
    (:class:`~fastft.fsm.GradsReady`); ``keep_gradients``: in an elastic world, keep a
    copy of the weighted local gradient before each step's allreduce (one more
    gradient-sized buffer), so that a retry after the world shrank computes only the lost
    members' samples (:mod:`fastft.protocol.shards`); ``checkpoint_dir``,
    ``checkpoint_every`` (steps), ``checkpoint_interval_s``, ``checkpoint_keep``: the
    durable tier (:mod:`fastft.runtime.durable.checkpoints`); with a directory and no
    schedule, every ``CHECKPOINT_INTERVAL_S``; ``allow_fresh_start``: when every
    holder of the committed state is lost and no checkpoint exists, start again from step
    0 instead of failing the job. ``secret_file``: the job secret every process of the job
    shares (``fastft run`` hands it to its workers): it authenticates control messages and
    decisions (:mod:`fastft.protocol.auth`); required. ``shard_size``: workers per shard
    group (HSDP, :mod:`fastft.runtime.groups.hsdp`): ranks ``r // shard_size`` shard one copy of
    the model and are the unit of fault; ``group_gen``: how many times the agent started
    this worker's group again (its members meet under it). ``sync``: how the replica groups
    sync, ``per-step``, ``every-k:N`` or ``diloco:N`` (:mod:`fastft.runtime.sync`).
    ``reseed``: seed Python's, NumPy's and torch's global generators from (``seed``, step,
    rank) as each step attempt begins (13 us), so a retry, a restart or a heal draws what
    the fault-free run drew; False (``fastft.init(reseed=False)``) for a script that seeds
    its own from the step (its registered generators are then its to keep).
    """

    store: str
    job: str
    rank: int
    world_size: int
    min_replicas: int | None = None
    life: int = 0
    run_dir: str | None = None
    inject: str | None = None
    heartbeat_file: str | None = None
    exit_trace_file: str | None = None
    relay_socket: str | None = None
    seed: int = 0
    reseed: bool = True
    rollback_timeout_s: float = 5.0
    start_timeout_s: float = 300.0
    regroup_timeout_s: float = REGROUP_TIMEOUT_S
    pg_timeout_s: float = 60.0
    max_step_retries: int = 3
    backend: str = "auto"
    incarnation: int | None = None
    check_every: int = 0
    compare_every: int = 40
    buffers: str = "average"
    decide: str = "auto"
    keep_gradients: bool = True
    node_silence_ms: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_interval_s: float = 0.0
    checkpoint_keep: int = 2
    allow_fresh_start: bool = False
    secret_file: str | None = None
    shard_size: int = 1
    group_gen: int = 0
    sync: str = "per-step"
    drain_grace_s: float = DRAIN_GRACE_S
    max_recoveries: int = MAX_RECOVERIES
    health_host_mb: int = HEALTH_HOST_MB
    hang_timeout_s: float = HANG_TIMEOUT_S
    hang_pace: bool = True
    between_steps_timeout_s: float = BETWEEN_STEPS_TIMEOUT_S
    flow: str | None = None
    flow_name: str = "pipeline"
    stage: str | None = None
    max_ahead: int = 1
    job_started: float | None = None

    def __post_init__(self) -> None:
        if ":" not in self.store:
            raise ConfigError(f"store {self.store!r}: expected HOST:PORT")
        if not self.job or "/" in self.job:
            raise ConfigError(f"job {self.job!r}: must be non-empty without '/'")
        if self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size}: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank}: must be in 0..{self.world_size - 1}")
        mr = self.world_size if self.min_replicas is None else self.min_replicas
        if not 1 <= mr <= self.world_size:
            raise ConfigError(f"min_replicas={mr}: must be in 1..{self.world_size}")
        object.__setattr__(self, "min_replicas", mr)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend={self.backend!r}: use auto, gloo or nccl")
        if self.max_step_retries < 0:
            raise ConfigError("max_step_retries must be >= 0")
        check_shard_groups(self.shard_size, self.world_size, self.min_members)
        check_sync(self.sync)
        check_decide(self.decide)
        check_stage(self.stage, self.flow, self.max_ahead, self.elastic, self.shard_size)
        if self.compare_every < 0:
            raise ConfigError(f"compare_every={self.compare_every}: use 0 (off) or N >= 1")
        if self.buffers not in ("average", "local"):
            raise ConfigError(f"buffers={self.buffers!r}: use average or local")
        if self.shard_size > 1 and self.checkpoint_dir:
            raise ConfigError(
                "--shard-size with --checkpoint-dir: the durable tier does not save shard "
                "groups yet; leave one of them out"
            )
        check_checkpoints(
            self.checkpoint_dir,
            self.checkpoint_every,
            self.checkpoint_interval_s,
            self.checkpoint_keep,
        )
        if self.checkpoint_dir and not (self.checkpoint_every or self.checkpoint_interval_s):
            object.__setattr__(self, "checkpoint_interval_s", CHECKPOINT_INTERVAL_S)

    @property
    def min_members(self) -> int:
        assert self.min_replicas is not None
        return self.min_replicas

    @property
    def sync_every(self) -> int:
        """Steps between the replica groups' syncs: 1 for ``per-step``."""
        return check_sync(self.sync)

    @property
    def sync_kind(self) -> str:
        """``per-step``, ``every-k`` or ``diloco``."""
        return self.sync.partition(":")[0]

    @property
    def elastic(self) -> bool:
        """Epochs may have fewer members than slots: survivors go on without a lost one."""
        return self.min_members < self.world_size

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> RuntimeConfig:
        """Read the launcher's variables (:class:`WorkerEnv`); an argument in ``overrides``
        wins over its variable. A missing or malformed variable is a ConfigError that names
        it (run the script under ``fastft run``, or set it)."""
        we = WorkerEnv.from_env(env, supplied=frozenset(overrides))
        known = {f.name for f in dataclasses.fields(WorkerEnv)}
        # a variable the launcher set wins over the field's default; the defaults are the
        # fields' own (written once, not copied here)
        own = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, object] = {
            name: v for name in sorted(known & own) if (v := getattr(we, name)) is not None
        }
        for k, v in overrides.items():
            kind = WORKER_FIELD_TYPES.get(k, "") if k in known else ""
            if v is not None and kind.startswith("int"):
                v = int(v)  # type: ignore[call-overload]
            elif v is not None and kind.startswith("bool"):
                v = bool(v)
            elif v is not None and kind.startswith("float"):
                v = float(v)  # type: ignore[arg-type]
            kw[k] = v
        return cls(**kw)  # type: ignore[arg-type]


def choose_backend(
    backend: str, devices: set[str], *, local_world: int, gpus: int
) -> tuple[str, str]:
    """The process-group backend for a model whose parameters live on ``devices``
    (device types), with ``local_world`` workers on this node and ``gpus`` GPUs visible.
    Returns ``(backend, why)``, ``why`` saying why ``auto`` did not pick NCCL for a model on
    the GPU (empty otherwise). Pure: every member of a job decides alike.

    * ``auto``: NCCL for a model on CUDA when every local worker has a GPU of its own
      (NCCL refuses two ranks on one GPU: "Duplicate GPU detected"), else Gloo (which
      reduces CUDA tensors through host memory);
    * ``nccl`` for a model that is not on CUDA, or with fewer GPUs than local workers, is a
      ConfigError that says what to change."""
    on_gpu = "cuda" in devices
    if backend == "gloo":
        return "gloo", ""
    if backend == "nccl":
        if not on_gpu:
            raise ConfigError(
                "backend nccl needs the model on a GPU (model.to('cuda') before "
                "ft.register), or use --backend gloo"
            )
        if local_world > gpus:
            raise ConfigError(
                f"backend nccl needs one GPU per worker: {local_world} workers on this node, "
                f"{gpus} GPU(s) visible (NCCL refuses two ranks on one GPU); "
                "lower --nproc or use --backend gloo"
            )
        return "nccl", ""
    if not on_gpu:
        return "gloo", ""
    if local_world > gpus:
        return "gloo", (
            f"auto chose gloo for a model on CUDA: {local_world} workers on this node share "
            f"{gpus} GPU(s), and NCCL needs one GPU per worker"
        )
    return "nccl", ""
