"""The environment ``fastft run`` gives each worker it starts (:class:`WorkerEnv`)."""

from __future__ import annotations

import os
from pathlib import Path

from fastft.launch.config import LaunchConfig
from fastft.process.env import SPARE_RUN_AHEAD, WorkerEnv

__all__ = ["worker_environment"]


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
