"""Every ``FASTFT_*`` environment variable, in one table, and the worker's environment.

Three kinds of variables:

* **worker**: set by the agent (``fastft run``) for each worker it starts, read once by
  :meth:`WorkerEnv.from_env` (the worker runtime, ``ManagerFFT``, the lighthouse);
* **spare**: set by the agent for a warm spare (:mod:`fastft.launch.procs.spare`);
* **flag**: the fall-back of a ``fastft run`` flag (``--nproc`` falls back to
  ``FASTFT_NPROC``). Those are generated from :class:`fastft.launch.settings.config.LaunchConfig`
  and listed by :func:`fastft.launch.settings.flags.flag_variables`; where a flag and a worker
  variable share a name (``FASTFT_STORE``, ``FASTFT_JOB``, ...) they mean the same thing.

Precedence, everywhere: an explicit argument, then the variable, then the default.
Variables are read at the edge (the CLI, :func:`fastft.init`), never inside constructors.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastft.errors import ConfigError

__all__ = [
    "BETWEEN_STEPS_TIMEOUT_S",
    "DRAIN_GRACE_S",
    "HANG_TIMEOUT_S",
    "HEALTH_HOST_MB",
    "MAX_RECOVERIES",
    "CUDA_DEVICE",
    "INSECURE",
    "MALLOC_TUNE",
    "PREFAULT_MB",
    "READY_FD",
    "SPARE_RUN_AHEAD",
    "SPARE_FEWEST",
    "SPARE_WORLD",
    "VARIABLES",
    "WORKER_FIELD_TYPES",
    "WORKER_VARS",
    "WorkerEnv",
    "ZYGOTE_FD",
    "ZYGOTE_PRELOAD",
    "insecure",
    "parse_bool",
]

# Defaults the agent's flags and the worker's config share, written once (issue 34).
# Timeouts order as STYLE 15 says: lease < rollback deadline < hang timeout < collective.
HANG_TIMEOUT_S = 30.0
"""Seconds a step may go without progress before its worker is killed as hung."""
BETWEEN_STEPS_TIMEOUT_S = 1800.0
"""The same between steps (an evaluation, a checkpoint), where long work is normal."""
DRAIN_GRACE_S = 30.0
"""After a SIGTERM: seconds the workers have to leave at their next commit."""
MAX_RECOVERIES = 50
"""Recoveries in a row without a commit before the job stops (a fault storm)."""
HEALTH_HOST_MB = 256
"""The health check's floor of available host memory (MiB)."""

SPARE_RUN_AHEAD = "FASTFT_SPARE_COMMAND"
SPARE_WORLD = "FASTFT_SPARE_WORLD"
SPARE_FEWEST = "FASTFT_SPARE_MIN_REPLICAS"
CUDA_DEVICE = "FASTFT_SPARE_CUDA_DEVICE"
READY_FD = "FASTFT_SPARE_READY_FD"
PREFAULT_MB = "FASTFT_SPARE_PREFAULT_MB"
ZYGOTE_FD = "FASTFT_ZYGOTE_FD"
ZYGOTE_PRELOAD = "FASTFT_ZYGOTE_PRELOAD"
MALLOC_TUNE = "FASTFT_MALLOC_TUNE"
INSECURE = "FASTFT_INSECURE_NO_AUTH"
CHECKPOINT_DIR = "FASTFT_CHECKPOINT_DIR"

VARIABLES: dict[str, str] = {
    # spares (set by the agent)
    SPARE_RUN_AHEAD: "spare: the worker's command line (JSON) when the spare runs the script "
    "ahead (--spare-run-ahead); fastft.init() waits there for the agent's order",
    SPARE_WORLD: "spare: the job's world size, for a JAX spare's rehearsal of the first "
    "step (fastft.jax: the shapes it compiles for)",
    SPARE_FEWEST: "spare: the job's --min-replicas, for a JAX spare's padded shards",
    CUDA_DEVICE: "spare: the GPU whose CUDA context the spare creates ahead of time",
    READY_FD: "spare: a pipe the spare writes one byte to once it is warm",
    PREFAULT_MB: "spare: MiB of heap memory the spare touches ahead of time (0: none)",
    ZYGOTE_FD: "zygote: its end of the agent's order socket",
    ZYGOTE_PRELOAD: "zygote: the modules it imports before it forks (--preload)",
    # any process
    MALLOC_TUNE: "process: 0 leaves glibc's malloc thresholds alone (default: tuned)",
    INSECURE: "process: 1 turns the job secret's tags off, in every process of the job "
    "(for measuring what they cost; anyone who reaches the store can then steer the job)",
}
"""Name -> what it is, for every variable that is not a :class:`WorkerEnv` field (those
add themselves below) nor a ``fastft run`` flag."""

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


def insecure(env: Mapping[str, str] | None = None) -> bool:
    """``FASTFT_INSECURE_NO_AUTH=1``: no tags on messages and values (measurement only)."""
    raw = (os.environ if env is None else env).get(INSECURE, "")
    return bool(raw) and parse_bool(INSECURE, raw)


def parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v not in _TRUE + _FALSE:
        raise ConfigError(f"{name}={raw!r}: expected 0 or 1")
    return v in _TRUE


def _var(name: str, doc: str, *, required: bool = False) -> Any:
    return field(
        default=None if not required else dataclasses.MISSING,
        metadata={"var": name, "doc": doc, "required": required},
    )


@dataclass(frozen=True)
class WorkerEnv:
    """What ``fastft run`` tells each worker, as environment variables (``to_env`` on the
    agent, ``from_env`` in the worker). ``None``: not set (the reader's default applies)."""

    store: str = _var("FASTFT_STORE", "HOST:PORT of the job's store", required=True)
    job: str = _var("FASTFT_JOB", "job id", required=True)
    rank: int = _var("FASTFT_RANK", "this worker's slot, stable across restarts", required=True)
    world_size: int = _var("FASTFT_WORLD_SIZE", "number of slots", required=True)
    min_replicas: int | None = _var("FASTFT_MIN_REPLICAS", "fewest members an epoch may have")
    life: int | None = _var("FASTFT_LIFE", "how many times this slot was started before")
    run_dir: str | None = _var("FASTFT_RUN_DIR", "the run directory (event log, heartbeats)")
    inject: str | None = _var("FASTFT_INJECT", "path of the fault plan (JSON)")
    heartbeat_file: str | None = _var("FASTFT_HEARTBEAT_FILE", "the worker's heartbeat file")
    exit_trace_file: str | None = _var("FASTFT_EXIT_TRACE_FILE", "the exit sentinel's file")
    relay_socket: str | None = _var(
        "FASTFT_RELAY_SOCKET",
        "the node's bus relay (its agent's Unix socket, @name: abstract): the worker hears the "
        "bus from it instead of subscribing to the store",
    )
    seed: int | None = _var("FASTFT_SEED", "the job's seed")
    incarnation: int | None = _var("FASTFT_INCARNATION", "this life's id, drawn by the agent")
    check_every: int | None = _var("FASTFT_CHECK_EVERY", "log the state digest every N commits")
    compare_every: int | None = _var(
        "FASTFT_COMPARE_EVERY", "compare the replicas' state in-band every N steps (0: off)"
    )
    buffers: str | None = _var("FASTFT_BUFFERS", "module buffers: average (default) or local")
    decide: str | None = _var(
        "FASTFT_DECIDE", "how a fault-free step is decided: auto (default), collective or store"
    )
    max_recoveries: int | None = _var(
        "FASTFT_MAX_RECOVERIES",
        "recoveries in a row without a committed step before the job stops (a fault storm)",
    )
    health_host_mb: int | None = _var(
        "FASTFT_HEALTH_HOST_MB",
        "health check: MiB of host memory that must be available before this worker joins",
    )
    node_silence_ms: int | None = _var(
        "FASTFT_NODE_SILENCE_MS",
        "several nodes: the shortest silence of a node after which it may be declared lost; a "
        "step decided by its collective this long after the member's previous commit is "
        "confirmed in the store before it commits",
    )
    hang_timeout_s: float | None = _var(
        "FASTFT_HANG_TIMEOUT", "seconds without progress before the agent kills this worker"
    )
    hang_pace: bool | None = _var(
        "FASTFT_HANG_PACE",
        "the agent judges a hang in a step by this worker's pace, not --hang-timeout alone",
    )
    between_steps_timeout_s: float | None = _var(
        "FASTFT_BETWEEN_STEPS_TIMEOUT",
        "seconds between steps (Python running) before the agent kills this worker",
    )
    drain_grace_s: float | None = _var(
        "FASTFT_DRAIN_GRACE",
        "after a SIGTERM, seconds this worker has to leave at its next commit before it ends",
    )
    keep_gradients: bool | None = _var(
        "FASTFT_KEEP_GRADIENTS", "elastic world: keep each step's local gradient (0 or 1)"
    )
    backend: str | None = _var("FASTFT_BACKEND", "process groups: auto, gloo or nccl")
    checkpoint_dir: str | None = _var(
        CHECKPOINT_DIR, "durable checkpoints of the committed state go here"
    )
    checkpoint_every: int | None = _var("FASTFT_CHECKPOINT_EVERY", "checkpoint every N steps")
    checkpoint_interval_s: float | None = _var(
        "FASTFT_CHECKPOINT_INTERVAL", "checkpoint every S seconds"
    )
    checkpoint_keep: int | None = _var("FASTFT_CHECKPOINT_KEEP", "checkpoints kept")
    allow_fresh_start: bool | None = _var(
        "FASTFT_ALLOW_FRESH_START",
        "when every holder of the state is lost and no checkpoint exists, start again from "
        "step 0 (0 or 1; otherwise the job fails)",
    )
    secret_file: str | None = _var(
        "FASTFT_SECRET_FILE",
        "path of the job secret (a file of mode 0600; the secret itself is never in the "
        "environment)",
    )
    shard_size: int | None = _var(
        "FASTFT_SHARD_SIZE",
        "workers per shard group (HSDP): ranks r // K form one replica group, 1 (default): "
        "one worker per replica",
    )
    sync: str | None = _var(
        "FASTFT_SYNC",
        "how replica groups sync: per-step (default), every-k:N (LocalSGD) or diloco:N",
    )
    flow: str | None = _var(
        "FASTFT_FLOW",
        "pipeline stages: HOST:PORT of the flow store the stages share (fastft.runtime.groups.flow)",
    )
    flow_name: str | None = _var("FASTFT_FLOW_NAME", "pipeline stages: the pipeline's name")
    stage: str | None = _var("FASTFT_STAGE", "pipeline stages: I/S, this job is stage I of S")
    max_ahead: int | None = _var(
        "FASTFT_MAX_AHEAD",
        "pipeline stages: steps a stage's commits may run ahead of the next stage's",
    )
    group_gen: int | None = _var(
        "FASTFT_GROUP_GEN",
        "how many times this worker's shard group was started again (its members meet on it)",
    )
    job_started: float | None = _var(
        "FASTFT_JOB_STARTED",
        "when the job began (wall clock, seconds): ft.elapsed_s counts from it, across "
        "restarts and nodes",
    )
    lighthouse: str | None = _var(
        "FASTFT_LIGHTHOUSE",
        "torchft replicas: 'bus' when their lighthouse announces joins on the bus "
        "(ManagerFFT's quorum leases are then on by default)",
    )

    def to_env(self) -> dict[str, str]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            out[f.metadata["var"]] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, supplied: frozenset[str] = frozenset()
    ) -> WorkerEnv:
        """Parse the variables; a missing required one (not in ``supplied``, the fields
        the caller passes explicitly) or a malformed one is a ConfigError that names it
        and says what to do."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = f.metadata["var"]
            raw = env.get(name)
            if not raw:
                if f.metadata["required"] and f.name not in supplied:
                    raise ConfigError(
                        f"{name} is not set: start the script with `fastft run` "
                        f"(or pass {f.name}= to fastft.init)"
                    )
                continue
            kind = str(f.type)
            if kind.startswith("int"):
                try:
                    kw[f.name] = int(raw)
                except ValueError:
                    raise ConfigError(f"{name}={raw!r}: expected an integer") from None
            elif kind.startswith("bool"):
                kw[f.name] = parse_bool(name, raw)
            elif kind.startswith("float"):
                try:
                    kw[f.name] = float(raw)
                except ValueError:
                    raise ConfigError(f"{name}={raw!r}: expected a number") from None
            else:
                kw[f.name] = raw
        for f in dataclasses.fields(cls):  # required ones the caller supplies
            kw.setdefault(f.name, None)
        return cls(**kw)

    @classmethod
    def present(cls, env: Mapping[str, str] | None = None) -> bool:
        """Whether this process was started by ``fastft run`` (its store is set)."""
        env = os.environ if env is None else env
        return bool(env.get("FASTFT_STORE"))


WORKER_VARS: dict[str, str] = {f.name: f.metadata["var"] for f in dataclasses.fields(WorkerEnv)}
""":class:`WorkerEnv` field -> its variable."""
WORKER_FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(WorkerEnv)}

for _f in dataclasses.fields(WorkerEnv):
    VARIABLES[_f.metadata["var"]] = "worker: " + _f.metadata["doc"]


def worker_slot(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """This worker's ``(rank, world_size)`` from ``fastft run``'s environment, for a
    framework that asks before ``fastft.init()`` (Lightning's strategy, Hugging Face's
    Trainer). A warm spare that runs the script ahead (``--spare-run-ahead``) has no rank
    until its order, which ``fastft.init()`` takes: ``(0, its world's size)`` until then.
    ConfigError outside a fastft job, naming the variable."""
    env = os.environ if env is None else env
    if SPARE_RUN_AHEAD in env:
        return 0, int(env.get(SPARE_WORLD) or 1)
    we = WorkerEnv.from_env(env)
    return int(we.rank), int(we.world_size)
