"""The environment ``fastft run`` gives each worker it starts (:class:`WorkerEnv`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from fastft.launch.settings.config import LaunchConfig
from fastft.process.env import SPARE_FEWEST, SPARE_RUN_AHEAD, SPARE_WORLD, WorkerEnv, insecure

__all__ = ["cpu_warnings", "worker_environment", "workers_line"]


_SHARED = tuple(
    f.name
    for f in dataclasses.fields(WorkerEnv)
    if f.name in {g.name for g in dataclasses.fields(LaunchConfig)}
)
"""The fields a worker reads as its agent's flag of the same name."""


def _contract(cfg: LaunchConfig, **life: Any) -> WorkerEnv:
    """The :class:`WorkerEnv` of one worker life: every flag the worker shares with its
    agent, derived from the field lists (not copied one by one; each is set, so a
    variable left in the agent's own environment cannot override a flag), then what only
    this life has (``life``). Paths are made absolute: a worker may change directory."""
    shared: dict[str, Any] = {name: getattr(cfg, name) for name in _SHARED}
    for name in ("inject", "checkpoint_dir"):
        if shared.get(name):
            shared[name] = str(Path(shared[name]).resolve())
    if not cfg.stage:  # (a pipeline's name and bound mean nothing to a job that is no stage)
        shared.pop("flow_name", None)
        shared.pop("max_ahead", None)
    shared["job"] = cfg.job
    for name in life:  # (this life's own: the store's address, the run directory, ...)
        shared.pop(name, None)
    lighthouse = "bus" if cfg.torchft == "fastft" else None
    return WorkerEnv(
        world_size=cfg.world_size,
        lighthouse=lighthouse,
        node_silence_ms=node_silence_ms(cfg),
        **shared,
        **life,
    )


def node_silence_ms(cfg: LaunchConfig) -> int | None:
    """The shortest silence after which a watcher may declare a node lost (several nodes):
    its lease less the one renewal that may have come just before the silence."""
    if cfg.nnodes < 2:
        return None
    from fastft.launch.rules.leasewatch import DEFAULT_MISSES  # (pure)

    return cfg.node_heartbeat_ms * ((cfg.node_lease_misses or DEFAULT_MISSES) - 1)


def worker_environment(
    cfg: LaunchConfig,
    *,
    rank: int,
    life: int,
    incarnation: int,
    local_rank: int,
    store_addr: str,
    run_dir: str,
    heartbeat_file: str,
    exit_trace_file: str | None,
    lighthouse_addr: str = "",
    secret_file: str | None = None,
    group_gen: int = 0,
    relay_socket: str | None = None,
    job_started: float | None = None,
) -> dict[str, str]:
    """The whole environment of one worker life: the agent's own, ``cfg.env``, the
    :class:`WorkerEnv` contract, torchrun's local names, and torchft's for ``--torchft``."""
    env = {
        **os.environ,
        **cfg.env,
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        **_contract(
            cfg,
            rank=rank,
            life=life,
            incarnation=incarnation,
            store=store_addr,
            run_dir=run_dir,
            heartbeat_file=heartbeat_file,
            exit_trace_file=exit_trace_file,
            secret_file=secret_file,
            relay_socket=relay_socket,
            group_gen=group_gen if cfg.shard_size > 1 else None,
            job_started=job_started,
        ).to_env(),
        # torchrun's names: scripts place their model on cuda:LOCAL_RANK
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
    }
    env.pop(SPARE_RUN_AHEAD, None)  # only a spare waits for an order
    env.pop(SPARE_WORLD, None)
    env.pop(SPARE_FEWEST, None)
    env.pop("FASTFT_JOB_SECRET_FILE", None)  # (the agent's flag; workers read the above)
    if cfg.nnodes == 1 and cfg.control is None:  # one node: the data plane on loopback too
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if cfg.torchft:
        env["TORCHFT_LIGHTHOUSE"] = lighthouse_addr
        env["REPLICA_GROUP_ID"] = str(rank)
        env["NUM_REPLICA_GROUPS"] = str(cfg.world_size)
        env.setdefault("RUST_LOG", "warn")  # torchft's per-step INFO logs halve a small step
    return env


def cpu_warnings(cfg: LaunchConfig, environ: dict[str, str] | Any, cores: int) -> list[str]:
    """Set each worker's CPU threads as torchrun does, and say what competes for the cores.

    Without ``OMP_NUM_THREADS`` (in ``environ`` or ``--env``), every worker's torch starts
    one thread per core: ``nproc`` workers then compete for every core (a step 3.2x slower
    with 2 workers on 2 cores). The agent sets it in ``environ`` (its own environment,
    which workers and spares inherit) to the cores over the workers, at least 1, and says
    so; then warns if the workers' threads, more than one each, outnumber the cores. Warm
    spares wait idle, and one thread per worker is the least there is: more workers than
    cores is the command's own choice (torchrun says nothing either; the demo warned about
    itself)."""
    out: list[str] = []
    threads = cfg.env.get("OMP_NUM_THREADS") or environ.get("OMP_NUM_THREADS")
    if threads is None and cfg.nproc > 1:
        threads = str(max(1, cores // cfg.nproc))
        environ["OMP_NUM_THREADS"] = threads
        out.append(
            f"OMP_NUM_THREADS={threads} for each of the {cfg.nproc} workers ({cores} CPU "
            "cores); set it yourself to tune it"
        )
    per = int(threads) if threads and threads.isdigit() and int(threads) > 0 else 1
    if per > 1 and cfg.nproc * per > cores:
        out.append(
            f"WARNING: {cfg.nproc} workers x {per} threads (OMP_NUM_THREADS) on {cores} CPU "
            "core(s): they will compete for the cores (steps slow down, timeouts fire "
            "sooner); lower OMP_NUM_THREADS or --nproc"
        )
    return out


def workers_line(cfg: LaunchConfig) -> str:
    """How many workers this node starts, for the start line (a forgotten --nproc ran one
    in silence)."""
    if cfg.nproc == 1:
        return "1 worker on this node (--nproc N for more)"
    return f"{cfg.nproc} workers on this node"


def start_lines(cfg: LaunchConfig, where: str, run_dir: Any, secret_file: Any) -> list[str]:
    """The agent's lines at its start: a job without its secret's tags, the CPU warnings,
    and the job's line (``where``: its store or control plane)."""
    lines = []
    if insecure():
        lines.append(
            "fastft: WARNING: FASTFT_INSECURE_NO_AUTH=1: control messages and decisions "
            "carry no tags; anything that reaches the store can steer this job"
        )
    cores = len(os.sched_getaffinity(0))
    lines += [f"fastft: {line}" for line in cpu_warnings(cfg, os.environ, cores)]
    lines.append(
        f"fastft: job {cfg.job!r}, {workers_line(cfg)}, {where}, run dir {run_dir}, "
        f"secret {secret_file}"
    )
    return lines
