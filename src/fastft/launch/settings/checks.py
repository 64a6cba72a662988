"""The checks of a :class:`~fastft.launch.settings.config.LaunchConfig` at start: each a
ConfigError that names the flag (or the flags that exclude each other) and what to change
(exit status 2). Pure, but for what a flag names: a file, a module, the GPUs."""

from __future__ import annotations

import os
import sys
from typing import Any

from fastft.errors import ConfigError
from fastft.launch.rules.offenders import QuarantineRule
from fastft.launch.settings.bounds import check_bounds, check_torchft

__all__ = ["check_config"]


def check_config(c: Any) -> None:
    """The ConfigError of the first thing wrong with ``c`` (a LaunchConfig)."""
    _workers(c)
    _nodes(c)
    _world(c)
    _modes(c)


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _workers(c: Any) -> None:
    """The worker command, its backend and how it starts."""
    if not c.command:
        raise ConfigError("no worker command: fastft run [flags] script.py [args]")
    if c.nproc < 1:
        raise ConfigError(f"--nproc {c.nproc}: must be >= 1")
    if c.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"--backend {c.backend!r}: use auto, gloo or nccl")
    if c.start_method not in ("zygote", "spawn"):
        raise ConfigError(f"--start-method {c.start_method!r}: use zygote or spawn")
    bad = [n for n in c.preload.split(",") if n and not _dotted(n)]
    if bad:
        raise ConfigError(f"--preload {','.join(bad)}: module names, comma-separated")
    if c.preload and c.start_method != "zygote":
        raise ConfigError("--preload: only the zygote preloads (--start-method zygote)")
    if c.backend == "nccl":  # the workers' own rule, checked before they start
        import torch

        from fastft.runtime.contract import choose_backend  # (a pure function)

        gpus = torch.cuda.device_count()  # no CUDA context in the agent
        choose_backend("nccl", {"cuda"}, local_world=c.nproc, gpus=gpus)


def _nodes(c: Any) -> None:
    """The nodes: their ranks, the control plane, the job secret, the store."""
    if c.nnodes < 1 or not 0 <= c.node_rank < c.nnodes:
        raise ConfigError(
            f"--node-rank {c.node_rank} with --nnodes {c.nnodes}: node rank must be in 0..nnodes-1"
        )
    if c.control is not None:
        from fastft.bus.nats import is_nats  # (pure)

        if c.store is not None:
            raise ConfigError("--control and --store: give one (the control plane)")
        if not all(is_nats(u.strip()) for u in c.control.split(",") if u.strip()):
            raise ConfigError(
                f"--control {c.control!r}: use nats://HOST:PORT[,nats://HOST:PORT...]"
            )
        try:
            import nats  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                f"--control nats needs the NATS client: pip install 'fastft[nats]' ({e})"
            ) from e
    elif c.nnodes > 1 and not c.store:
        raise ConfigError(
            "--nnodes > 1 needs --store HOST:PORT (node 0 hosts it) or --control nats://..."
        )
    if c.job_secret_file is not None:
        from fastft.protocol.auth import JobSecret  # (a file check)

        JobSecret.load(c.job_secret_file)
    elif c.nnodes > 1:
        raise ConfigError(
            "--nnodes > 1 needs --job-secret-file PATH: one secret every node's agent "
            "reads (create it once with `fastft secret new PATH`, copy it to each node "
            "with mode 0600)"
        )
    if c.store is not None:
        host, _, port = c.store.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--store {c.store!r}: expected HOST:PORT")


def _world(c: Any) -> None:
    """The numbers, the world, warm spares, a standby, the fault plan, torchft."""
    check_bounds(c)  # (the numbers: counts, timeouts, ports)
    QuarantineRule.parse(c.quarantine)  # (a malformed --quarantine fails here)
    world = c.nproc * c.nnodes
    if c.min_replicas is not None and not 1 <= c.min_replicas <= world:
        raise ConfigError(f"--min-replicas {c.min_replicas}: must be in 1..{world}")
    if c.warm_spares and (
        len(c.command) < 2 or os.path.basename(c.command[0]) != os.path.basename(sys.executable)
    ):
        raise ConfigError(
            f"--warm-spares needs a Python worker (script.py or -m module), not {c.command[0]!r}"
        )
    if c.spare_run_ahead and not c.warm_spares:
        raise ConfigError("--spare-run-ahead needs warm spares: add --warm-spares N")
    if c.standby and (c.nnodes < 2 or (c.node_rank == 0 and not c.control)):
        raise ConfigError(
            "--standby takes over a node of several (--nnodes > 1), and node 0 only with "
            "--control nats://... (on a TCPStore node 0 hosts it: its loss ends the job)"
        )
    if c.inject is not None:
        from fastft.inject import FaultPlan

        FaultPlan.load(c.inject)  # fails now, with the plan's own message
    check_torchft(c)


def _modes(c: Any) -> None:
    """The modes that exclude each other (shard groups, --sync, --stage, --torchft), the checkpoints, the lease, the job's name."""
    world = c.nproc * c.nnodes
    from fastft.runtime.contract import (  # (pure)
        check_checkpoints,
        check_decide,
        check_shard_groups,
        check_stage,
        check_sync,
    )

    if c.shard_size > 1 and c.nproc % c.shard_size:
        raise ConfigError(
            f"--shard-size {c.shard_size} does not divide --nproc {c.nproc}: a shard "
            "group lies on one node; use a divisor of --nproc"
        )
    check_shard_groups(c.shard_size, world, c.min_replicas or world)
    check_sync(c.sync)
    check_decide(c.decide)
    check_stage(
        c.stage,
        c.flow,
        c.max_ahead,
        (c.min_replicas or world) < world,
        c.shard_size,
    )
    if c.stage is not None and c.torchft:
        raise ConfigError("--stage with --torchft: leave one of them out")
    if c.sync != "per-step" and c.torchft:
        raise ConfigError(
            f"--sync {c.sync} with --torchft: torchft's Manager syncs every step; "
            "leave one of them out"
        )
    if c.shard_size > 1 and (c.checkpoint_dir or c.torchft):
        raise ConfigError(
            f"--shard-size with --{'checkpoint-dir' if c.checkpoint_dir else 'torchft'}: "
            "shard groups do not work with it yet; leave one of them out"
        )

    check_checkpoints(
        c.checkpoint_dir,
        c.checkpoint_every,
        c.checkpoint_interval_s,
        c.checkpoint_keep,
    )
    from fastft.launch.rules.leasewatch import DEFAULT_MISSES, LeaseConfig  # (pure)

    LeaseConfig(c.node_heartbeat_ms, c.node_lease_misses or DEFAULT_MISSES)
    if "/" in c.job or not c.job:
        raise ConfigError(f"--job {c.job!r}: non-empty, without '/'")
