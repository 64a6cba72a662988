"""The environment ``fastft run`` gives each worker it starts (:class:`WorkerEnv`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastft.launch.config import LaunchConfig
from fastft.process.env import SPARE_RUN_AHEAD, WorkerEnv

__all__ = ["cpu_warnings", "worker_environment", "workers_line"]


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
) -> dict[str, str]:
    """The whole environment of one worker life: the agent's own, ``cfg.env``, the
    :class:`WorkerEnv` contract, torchrun's local names, and torchft's for ``--torchft``."""
    env = {
        **os.environ,
        **cfg.env,
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        **WorkerEnv(
            store=store_addr,
            job=cfg.job,
            rank=rank,
            world_size=cfg.world_size,
            min_replicas=cfg.min_replicas,
            life=life,
            run_dir=run_dir,
            inject=str(Path(cfg.inject).resolve()) if cfg.inject else None,
            heartbeat_file=heartbeat_file,
            exit_trace_file=exit_trace_file,
            seed=cfg.seed,
            incarnation=incarnation,
            check_every=cfg.check_every,
            drain_grace_s=cfg.drain_grace_s,
            health_host_mb=cfg.health_host_mb,
            hang_timeout_s=cfg.hang_timeout_s,
            between_steps_timeout_s=cfg.between_steps_timeout_s,
            max_recoveries=cfg.max_recoveries,
            keep_gradients=cfg.keep_gradients,
            backend=cfg.backend,
            lighthouse="bus" if cfg.torchft == "fastft" else None,
            checkpoint_dir=str(Path(cfg.checkpoint_dir).resolve()) if cfg.checkpoint_dir else None,
            checkpoint_every=cfg.checkpoint_every,
            checkpoint_interval_s=cfg.checkpoint_interval_s,
            checkpoint_keep=cfg.checkpoint_keep,
            allow_fresh_start=cfg.allow_fresh_start,
            secret_file=secret_file,
            shard_size=cfg.shard_size if cfg.shard_size > 1 else None,
            group_gen=group_gen if cfg.shard_size > 1 else None,
            sync=cfg.sync if cfg.sync != "per-step" else None,
            flow=cfg.flow,
            flow_name=cfg.flow_name if cfg.stage else None,
            stage=cfg.stage,
            max_ahead=cfg.max_ahead if cfg.stage else None,
        ).to_env(),
        # torchrun's names: scripts place their model on cuda:LOCAL_RANK
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
    }
    env.pop(SPARE_RUN_AHEAD, None)  # only a spare waits for an order
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
    so; then warns if the workers' and spares' threads still outnumber the cores."""
    out: list[str] = []
    procs = cfg.nproc + cfg.warm_spares
    threads = cfg.env.get("OMP_NUM_THREADS") or environ.get("OMP_NUM_THREADS")
    if threads is None and cfg.nproc > 1:
        threads = str(max(1, cores // cfg.nproc))
        environ["OMP_NUM_THREADS"] = threads
        out.append(
            f"OMP_NUM_THREADS={threads} for each of the {cfg.nproc} workers ({cores} CPU "
            "cores); set it yourself to tune it"
        )
    per = int(threads) if threads and threads.isdigit() and int(threads) > 0 else 1
    if procs * per > cores:
        out.append(
            f"WARNING: {procs} worker and spare processes x {per} thread(s) on {cores} CPU "
            "core(s): they will compete for the cores (steps slow down, timeouts fire "
            "sooner); lower --nproc, --warm-spares or OMP_NUM_THREADS"
        )
    return out


def workers_line(cfg: LaunchConfig) -> str:
    """How many workers this node starts, for the start line (a forgotten --nproc ran one
    in silence)."""
    if cfg.nproc == 1:
        return "1 worker on this node (--nproc N for more)"
    return f"{cfg.nproc} workers on this node"
