"""``fastft run``'s configuration: :class:`LaunchConfig`, one field per flag.

Each field carries its flag, its help and its default, in one place: the CLI builds its
parser from them (:func:`fastft.launch.settings.flags.add_run_flags`), and every flag falls back to
a ``FASTFT_*`` variable named after it (``--hang-timeout`` -> ``FASTFT_HANG_TIMEOUT``;
:func:`fastft.launch.settings.flags.flag_variables` lists them): the flag, then the variable, then
the default."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from fastft.launch.rules.offenders import QuarantineRule
from fastft.launch.settings.bounds import BUFFERS
from fastft.launch.settings.checks import check_config
from fastft.runtime.contract import RuntimeConfig

__all__ = ["LaunchConfig"]

DEFAULT_PREFAULT_MB = 0
"""Off by default: it makes a spare ready later (the touching is part of its warm-up); it
pays for large CPU-resident states (docs/measurements.md, "Spare prefault")."""

RELAY_AUTO_WORKERS = 64
"""``--bus-relay auto`` relays from this many workers on (docs/measurements.md, "The bus relay")."""


def _flag(default: Any, help: str, *, flag: str = "", choices: tuple[str, ...] = ()) -> Any:
    meta = {"help": help, "flag": flag, "choices": choices}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


def _worker(name: str, help: str, *, flag: str = "", choices: tuple[str, ...] = ()) -> Any:
    """A flag passed on to the workers: its default is theirs
    (:class:`~fastft.runtime.contract.RuntimeConfig`'s field ``name``), written once."""
    return _flag(_WORKER[name].default, help, flag=flag, choices=choices)


_WORKER = {f.name: f for f in fields(RuntimeConfig)}


@dataclass(frozen=True)
class LaunchConfig:
    """``fastft run`` flags. ``command``: the worker command line."""

    command: tuple[str, ...]
    nproc: int = _flag(1, "workers on this node")
    nnodes: int = _flag(1, "nodes in the job (one agent each)")
    node_rank: int = _flag(0, "this node's index")
    store: str | None = _flag(
        None, "HOST:PORT of the store (node 0 hosts it; default: a free port)"
    )
    control: str | None = _flag(
        None,
        "the control plane (bus, decisions, epochs, leases): nats://H1:4222,nats://H2:4222,... "
        "for a NATS cluster with JetStream, which no host's loss ends (fastft nats up starts "
        "a local one); default: the TCPStore node 0's agent hosts (--store)",
    )
    bus_relay: str = _flag(
        "auto",
        "on: this node's workers hear the error bus through this agent (a broadcast costs "
        "the store one push per node); off: each subscribes to the store; auto: on from "
        f"{RELAY_AUTO_WORKERS} workers in the job, with 2+ on this node",
        choices=("auto", "on", "off"),
    )
    job: str = _flag("job", "job id")
    max_restarts: int = _flag(3, "restarts per worker")
    inject: str | None = _worker("inject", "fault plan JSON (fastft plan check)")
    hang_timeout_s: float = _worker(
        "hang_timeout_s",
        "seconds without progress before a worker is killed (the most, with its pace)",
        flag="--hang-timeout",
    )
    between_steps_timeout_s: float = _worker(
        "between_steps_timeout_s",
        "seconds a worker may spend between steps (an evaluation, a checkpoint) while its "
        "Python runs before it is killed as hung; --hang-timeout judges steps",
        flag="--between-steps-timeout",
    )
    hang_pace: bool = _worker(
        "hang_pace",
        "judge a hang in a step by the worker's own pace: silent for 10x its recent steps' "
        "compute (their 99th percentile; at least 0.5 s, at most --hang-timeout)",
    )
    stragglers: str = _flag(
        "report",
        "a worker whose steps compute --straggler-factor times longer than the others' "
        "makes every step wait for it: report names it (an event, a line, a metric); "
        "replace also drains it and a spare or a restart takes its place; off",
        choices=("off", "report", "replace"),
    )
    straggler_factor: float = _flag(1.3, "how much slower than the others a straggler computes")
    start_grace_s: float = _flag(
        120.0, "seconds a worker may take to write its first heartbeat", flag="--start-grace"
    )
    store_wait_s: float = _flag(
        60.0,
        "seconds to wait for node 0's store: at the start, and when it stops answering (this "
        "node cut off, or node 0 gone); and for a node that left before the job finished "
        "(drained) to start again, where the job cannot go on without it",
        flag="--store-wait",
    )
    min_replicas: int | None = _worker(
        "min_replicas",
        "fewest workers an epoch may have; below the world size the survivors go on without a "
        "lost worker and it rejoins when restarted (default: all, fixed world)",
    )
    shard_size: int = _worker(
        "shard_size",
        "workers per shard group (HSDP): ranks r // K shard one copy of the model (FSDP2) and "
        "are the unit of fault; must divide --nproc (default 1: one worker per replica)",
    )
    sync: str = _worker(
        "sync",
        "how replica groups sync: per-step (every step's gradients averaged) or every-k:N "
        "(LocalSGD: groups step on their own gradients, and every N-th step starts from "
        "their averaged parameters and optimizer state and applies the averaged gradient) "
        "or diloco:N (groups step on their own; every N steps an outer optimizer, Nesterov "
        "SGD by default, steps on the pseudo-gradient averaged over the groups)",
    )
    stage: str | None = _worker(
        "stage",
        "I/S: this job is stage I of a pipeline of S stages, each its own job; they meet in "
        "the flow store (--flow) and stage I commits at most --max-ahead steps ahead of I+1",
    )
    flow: str | None = _worker("flow", "HOST:PORT of the flow store the pipeline's stages share")
    flow_name: str = _worker("flow_name", "the pipeline's name in the flow store")
    max_ahead: int = _worker(
        "max_ahead", "steps a stage's commits may run ahead of the next stage's"
    )
    max_recoveries: int = _worker(
        "max_recoveries",
        "recoveries in a row without a committed step after which the job stops with exit "
        "1 (a fault storm) instead of restarting forever",
    )
    health_host_mb: int = _worker(
        "health_host_mb",
        "health check before a worker joins or rejoins: MiB of host memory that must be "
        "available (0: no check); a worker that fails a health check is not admitted",
        flag="--health-host-mb",
    )
    quarantine: str = _flag(
        "3/600",
        "N/S: a worker slot that faults N times within S seconds is a repeat offender: its "
        "next life is a warm spare, or the world shrinks (elastic), or the job stops; 'off'",
    )
    drain_grace_s: float = _worker(
        "drain_grace_s",
        "after a SIGTERM (or fastft drain --node), seconds the workers have to leave at "
        "their next commit before they are stopped",
        flag="--drain-grace",
    )
    run_dir: str | None = _worker(
        "run_dir", "event log and heartbeats (default: a new ./runs/JOB-TIME-PID)"
    )
    metrics_port: int | None = _flag(
        None,
        "serve Prometheus metrics on this port (0: one the OS picks; the agent prints it), "
        "from the run's event log (needs fastft[metrics])",
    )
    metrics_addr: str = _flag("127.0.0.1", "the address --metrics-port binds")
    log_dir: str | None = _flag(
        None,
        "also write each worker life's stdout and stderr to DIR/rank{R}/life{L}.stdout and "
        ".stderr (the console shows every line prefixed [rank R.L]: either way)",
    )
    tee: int = _flag(
        3,
        "with --log-dir, which streams still reach the console: 0 none, 1 stdout, 2 stderr, "
        "3 both (torchrun's --tee)",
    )
    seed: int = _worker("seed", "the job's seed")
    check_every: int = _worker(
        "check_every", "log the state digest every N commits (S3 check; 0: never)"
    )
    compare_every: int = _worker(
        "compare_every", "compare the replicas' state in-band every N steps (0: off)"
    )
    buffers: str = _worker(
        "buffers", "BatchNorm statistics: average (over the members) or local", choices=BUFFERS
    )
    decide: str = _worker(
        "decide",
        "how a fault-free step is decided: collective (every member's yes vote rides its "
        "gradients' allreduce, or an allreduce of its own after them where it cannot: no "
        "store request; the store decides only when a drain or a join is in flight), store "
        "(every member votes in the store every step: 2-3 requests per member and step) or "
        "auto (collective where the vote rides the gradients, on NCCL, on NATS and from 16 "
        "members; else the store's vote)",
    )
    start_method: str = _flag(
        "zygote",
        "how workers start: zygote (a fork of a process of this node that imported torch, "
        "fastft and --preload once: milliseconds) or spawn (a new Python each time: "
        "seconds); a command that is no script of this Python always spawns",
        choices=("zygote", "spawn"),
    )
    preload: str = _flag(
        "",
        "modules the zygote imports before it forks, comma-separated (your heavy imports: "
        "transformers, your model's code); one that fails to import, or starts a thread, "
        "fails the job at start",
    )
    warm_spares: int = _flag(
        0,
        "processes kept ready with torch imported; a restarted worker becomes one instead of "
        "starting Python",
    )
    torchft: str | None = _flag(
        None,
        "run torchft replicas (one per worker) and start their lighthouse: 'fastft' "
        "(ManagerFFT workers; the lighthouse hears deaths on the error bus) or 'plain' "
        "(torchft's own lighthouse; exits restarted, stops and hangs left to torchft)",
        choices=("fastft", "plain"),
    )
    lighthouse_heartbeat_ms: int = _flag(5000, "torchft lighthouse heartbeat timeout (ms)")
    lighthouse_join_ms: int = _flag(60000, "torchft lighthouse join timeout (ms)")
    exit_trace: bool = _flag(
        True,
        "trace each worker's exit sentinel (fastft.launch.procs.exit_trace): a death is published "
        "before the kernel frees the worker's memory (15-50 ms sooner); off lets a debugger "
        "or py-spy attach",
    )
    keep_gradients: bool = _worker(
        "keep_gradients",
        "elastic world: keep a copy of each step's local gradient, so that a step that rolled "
        "back recomputes only the samples no member kept (one gradient-sized buffer)",
    )
    spare_cuda: bool = _flag(
        True,
        "warm spares create a CUDA context on the GPU of the worker they are likely to "
        "replace, where GPUs are visible",
    )
    spare_prefault_mb: int = _flag(
        DEFAULT_PREFAULT_MB,
        "MiB of heap memory each warm spare touches while it waits (its idle RSS grows by "
        "that much, and it is ready later), so that the worker it becomes does not "
        "page-fault its model and healed state on the recovery path (e.g. 192)",
    )
    spare_run_ahead: bool = _flag(
        False,
        "warm spares run the script up to its fastft.init() before they are needed, so that "
        "the model and optimizer it builds before are off the recovery path; the script must "
        "not need its rank before fastft.init()",
    )
    standby: bool = _flag(
        False,
        "start warm (the zygote imports torch and the script's modules), wait for a line on "
        "stdin, then take this node over from its dead agent: its workers are declared dead "
        "at once, not after the lease (fastft ray run keeps one per node)",
    )
    backend: str = _worker(
        "backend",
        "process groups: gloo, nccl (one GPU per worker) or auto (nccl for a model on CUDA "
        "when each worker of the node has a GPU of its own, else gloo)",
    )
    checkpoint_dir: str | None = _worker(
        "checkpoint_dir",
        "durable checkpoints of the committed state (shared by every node): used when every "
        "holder of the state is lost, and to resume a job run again with the same directory",
    )
    checkpoint_every: int = _worker(
        "checkpoint_every", "checkpoint every N committed steps (0: not by steps)"
    )
    checkpoint_interval_s: float = _worker(
        "checkpoint_interval_s",
        "checkpoint every S seconds (0: not by time; with --checkpoint-dir and neither "
        "schedule: 600)",
        flag="--checkpoint-interval",
    )
    checkpoint_keep: int = _worker(
        "checkpoint_keep", "complete checkpoints kept (older ones are removed)"
    )
    allow_fresh_start: bool = _worker(
        "allow_fresh_start",
        "when every holder of the committed state is lost and there is no checkpoint, start "
        "again from step 0 (otherwise the job fails and says so)",
    )
    node_heartbeat_ms: int = _flag(
        100,
        "multi-node: each agent renews its node's lease this often (ms); a node whose lease "
        "is not renewed for --node-lease-misses heartbeats is declared lost, its workers dead",
    )
    node_lease_misses: int | None = _flag(
        None, "multi-node: heartbeats a node may miss before it is lost (default 3)"
    )
    node_beats: str = _flag(
        "auto",
        "multi-node on a TCPStore: how the agents' lease beats travel: through the store "
        "(store), from agent to agent over TCP, the store reading only the marks and "
        "deciding each declaration (peers), or peers above 256 nodes (auto); NATS: core "
        "messages always",
        choices=("auto", "store", "peers"),
    )
    job_secret_file: str | None = _flag(
        None,
        "the job secret (a file of mode 0600, the same on every node; fastft secret new PATH "
        "writes one): it authenticates every control message and decision; default on one "
        "node: a new one in the run dir",
    )
    env: dict[str, str] = _flag({}, "")
    """Extra environment for the workers (not a flag)."""

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def quarantine_rule(self) -> QuarantineRule | None:
        """``--quarantine N/S`` parsed (None: ``off``)."""
        return QuarantineRule.parse(self.quarantine)

    @property
    def relayed(self) -> bool:
        """Whether this node's workers hear the bus through its agent (``--bus-relay``)."""
        auto = self.nproc > 1 and self.world_size >= RELAY_AUTO_WORKERS
        return self.bus_relay == "on" or (self.bus_relay == "auto" and auto)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes
