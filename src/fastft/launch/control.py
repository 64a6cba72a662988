"""What one agent opens of the job's control plane before it starts any worker: the store
(node 0 hosts a TCPStore, listening on the address given alone), the job secret, the signed
store client and the agent's bus endpoint (with the node's bus relay, which listens once
the endpoint starts)."""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastft.bus import BusConfig, BusEndpoint, RelayHub, connect_store, host_store, open_bus
from fastft.bus.signed import SignedStore
from fastft.bus.tcpstore import WILDCARDS, is_local_address
from fastft.errors import ConfigError
from fastft.launch.settings.config import LaunchConfig
from fastft.process.env import insecure
from fastft.protocol import NO_RANK, JobKeys, Role
from fastft.protocol.auth import JobSecret, ValueAuth

__all__ = ["ControlPlane", "first_lives_base"]

log = logging.getLogger(__name__)


@dataclass
class ControlPlane:
    server: Any
    """The TCPStore server node 0 hosts (None elsewhere, and with --control)."""
    bound: str
    """Where that server listens (HOST:PORT), "" if none."""
    address: str
    """What this node's processes connect to."""
    secret_file: Path
    store: SignedStore
    """The job's store; decisions, node marks and joiner keys signed (fastft.bus.signed)."""
    bus: BusEndpoint
    hub: RelayHub | None
    """This node's bus relay (``--bus-relay``), which its workers hear the bus from; None:
    each subscribes to the store itself. The bus endpoint owns it."""
    started: float
    """When the job began (wall clock): its first agent's start, the same on every node."""

    @classmethod
    def open(cls, config: LaunchConfig, run_dir: Path, keys: JobKeys) -> ControlPlane:
        server, bound, address = _host_or_join(config)
        secret_file, secret = _secret(config, run_dir)
        raw = connect_store(address, wait_s=config.store_wait_s)
        store = SignedStore(raw, keys, ValueAuth(secret), insecure=insecure())
        cfg = BusConfig(
            job=config.job,
            rank=NO_RANK,
            incarnation=secrets.randbits(62) | 1,
            role=Role.AGENT,
            secret=None if insecure() else secret,
        )
        hub = RelayHub(cfg.max_queue, cfg.stale_s) if config.relayed else None
        same_settings(raw, keys, config)
        bus = open_bus(raw, cfg, hub=hub)
        return cls(server, bound, address, secret_file, store, bus, hub, job_start(raw, keys))


def job_start(store: Any, keys: JobKeys) -> float:
    """The job's start: this agent's now if it is the first, else the first one's (a
    restarted node's agent, a later node: the job's clock does not start again)."""
    now = f"{time.time():.3f}"
    try:
        return float(bytes(store.compare_set(keys.started, "", now)).decode() or now)
    except (ValueError, RuntimeError, OSError):
        return float(now)  # (the job's clock is a convenience: never a failed start)


def first_lives_base(store: Any, keys: JobKeys, node: int) -> int:
    """The base of this node's first lives' incarnations (rank ``r``'s is base + r): the
    job's, shared by every node's first agent, so that a first start's view is one run of
    ranks and incarnations that reads in a few bytes (16,384 random incarnations made
    every joiner read 160 KB: O(N^2) through the servers, issue 64). A node's later agent
    (a standby, one started again) draws its own: its lives are new. Incarnations only
    tell a rank's lives apart; the messages carry the job secret's tag."""
    mine = secrets.randbits(60) + 1
    try:
        token = secrets.token_hex(8)
        if bytes(store.compare_set(keys.node_first(node), "", token)).decode() != token:
            return mine  # (this node had an agent before)
        got = bytes(store.compare_set(keys.first_lives, "", str(mine))).decode()
        base = int(got)
    except (ValueError, RuntimeError, OSError) as e:
        log.warning("the first lives' incarnations: %s; drawn by this node", e)
        return mine
    return base if 0 < base < 1 << 61 else mine


SHARED = ("decide", "compare_every", "shard_size", "sync")
"""The flags every node of a job must give alike: each changes which collectives a step
runs (``--decide collective`` adds one; the replica check another, every N steps; shard
groups and ``--sync`` change the groups), and members that run different ones wait for
each other until the process group's timeout."""


def settings_text(config: LaunchConfig) -> str:
    return json.dumps({k: getattr(config, k) for k in SHARED}, sort_keys=True)


def mismatch(mine: str, first: str) -> str | None:
    """Why this node cannot join a job whose first node runs ``first`` (None: it can)."""
    if mine == first:
        return None
    a, b = json.loads(mine), json.loads(first)
    diff = ", ".join(
        f"--{k.replace('_', '-')} {a.get(k)} here, {b.get(k)} there"
        for k in SHARED
        if a.get(k) != b.get(k)
    )
    return (
        f"this node's settings differ from the job's first node's ({diff}): every node must "
        "run the same (its workers would run different collectives and wait for each other "
        "until the process group's timeout); start it with the job's flags"
    )


def same_settings(store: Any, keys: JobKeys, config: LaunchConfig) -> None:
    """Record the job's shared settings (the first agent) or check this one's against them:
    ConfigError (exit 2 at the start) when they differ."""
    mine = settings_text(config)
    try:
        first = bytes(store.compare_set(keys.settings, "", mine)).decode() or mine
    except (RuntimeError, OSError, ValueError):
        return  # (the store's loss is for the lease to judge)
    why = mismatch(mine, first)
    if why is not None:
        raise ConfigError(why)


def _host_or_join(config: LaunchConfig) -> tuple[Any, str, str]:
    """(server, bound, address): node 0 hosts the store when ``--store`` names an address of
    its own (or is not given); every other agent connects to it, or to ``--control``."""
    if config.control is not None:  # a NATS cluster: no agent hosts anything
        return None, "", config.control
    if config.node_rank == 0 and (
        config.store is None or is_local_address(config.store.rpartition(":")[0])
    ):
        port = int(config.store.rpartition(":")[2]) if config.store else 0
        host = "127.0.0.1" if config.store is None else config.store.rpartition(":")[0]
        server = host_store(host, port)  # listening on `host` alone
        local = host if host not in WILDCARDS and host != "localhost" else "127.0.0.1"
        return server, f"{host}:{server.port}", f"{local}:{server.port}"
    assert config.store is not None
    return None, "", config.store


def _secret(config: LaunchConfig, run_dir: Path) -> tuple[Path, JobSecret]:
    """The job secret: ``--job-secret-file``, or (one node) a new one in the run dir, mode
    0600, whose path the workers are given (never the secret itself)."""
    if config.job_secret_file:
        path = Path(config.job_secret_file).resolve()
        return path, JobSecret.load(path)
    path = run_dir / "job.secret"
    path.unlink(missing_ok=True)  # a run dir used again: a new job, a new secret
    secret = JobSecret.draw()
    secret.save(path)
    return path, secret
