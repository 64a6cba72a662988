"""A torchft replica under ``fastft run``: the ``Manager`` arguments ``ManagerFFT`` sets,
and the tap on torchft's quorum client (reports each quorum, answers leased ones)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from fastft.errors import ConfigError
from fastft.integrations.torchft.quorum import fastft_replica_id
from fastft.process.env import WorkerEnv

__all__ = ["QuorumTap", "advertised_host", "connect", "under_fastft_kwargs"]


class QuorumTap:
    """Forwards to torchft's ManagerClient and reports each quorum's members; answers from
    ``reuse`` (a leased quorum) instead when it has one."""

    def __init__(
        self, client: Any, reuse: Callable[[], Any], on_quorum: Callable[[Any], None]
    ) -> None:
        self._client = client
        self._reuse = reuse
        self._on_quorum = on_quorum

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        q = self._reuse()
        if q is not None:
            return q
        q = self._client._quorum(*args, **kwargs)  # noqa: SLF001 - torchft's quorum client, which it exposes no other way
        self._on_quorum(q)
        return q

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def advertised_host(store: str) -> str:
    """The host name torchft advertises: loopback when the job's store is local."""
    return "127.0.0.1" if store.startswith("127.0.0.1:") else socket.gethostname()


def under_fastft_kwargs(
    kwargs: dict[str, Any], env: Mapping[str, str], rank: int, incarnation: int, store: str = ""
) -> Any:
    """What ``ManagerFFT`` changes in torchft's ``Manager`` arguments under ``fastft run``
    (in place): the replica id names the life (``fastft-<rank>-<incarnation>/<id>``), the
    host is loopback for a single-node job, the heartbeat is 1 s (the bus, not the
    lighthouse's heartbeat timeout, reports a dead replica), and a replica group of one
    process without a store gets one of its own. Returns that store's server, or None."""
    kwargs["replica_id"] = fastft_replica_id(
        rank, incarnation, str(kwargs.get("replica_id") or env.get("REPLICA_GROUP_ID", rank))
    )
    kwargs.setdefault("hostname", advertised_host(store))
    # The lighthouse's heartbeat (5 s timeout) is only the backstop for a node lost with
    # its agent; each beat costs the Python BusLighthouse CPU (bench/lighthouse_rpc.py).
    kwargs.setdefault("heartbeat_interval", timedelta(seconds=1))
    if (
        kwargs.get("store_addr") is None
        and "MASTER_ADDR" not in env
        and int(kwargs.get("world_size") or env.get("WORLD_SIZE", "1")) == 1
    ):
        import torch.distributed as dist

        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        kwargs["store_addr"] = "127.0.0.1"
        kwargs["store_port"] = server.port
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("world_size", 1)
        return server
    return None


def connect(
    store: str,
    job: str,
    *,
    replica: int | None = None,
    replicas: int | None = None,
    run_dir: str | None = None,
    announces_joins: bool = False,
    env: Mapping[str, str] | None = None,
    secret_file: str | None = None,
) -> WorkerEnv:
    """The error bus for a ``ManagerFFT`` started by any launcher (torchrun, torchx, SLURM):
    ``ManagerFFT(pg, ..., bus=connect("host:port", "my-job"))``.

    ``store``: ``HOST:PORT`` of a TCPStore that every replica group reaches (one for the
    whole job, not a group's own); ``job``: the job's id (bus subjects and keys live under
    it); ``replica``: this replica group's index in the job (default: torchft's
    ``REPLICA_GROUP_ID``, else torchrun's ``RANK``); ``replicas``: how many there are
    (default: ``NUM_REPLICA_GROUPS``, else 1); ``run_dir``: where to write the event log
    (default: none); ``announces_joins``: the lighthouse announces joins on the bus
    (fastft's BusLighthouse), which turns quorum leases on by default. Every process life
    draws its own incarnation. Without ``fastft run``'s agent nobody reports a process that
    dies or hangs: the bus carries the replicas' own errors (``report_error``, an uncaught
    exception), and torchft's timeouts handle the rest. ``secret_file``: the job secret
    every replica shares (default: ``FASTFT_SECRET_FILE``; ``fastft secret new PATH``
    writes one); the bus authenticates every message with it."""
    env = os.environ if env is None else env
    host, _, port = store.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"connect(store={store!r}): expected HOST:PORT of a TCPStore")
    if not job or "/" in job:
        raise ConfigError(f"connect(job={job!r}): a non-empty id without '/'")
    if replica is None:
        raw = env.get("REPLICA_GROUP_ID") or env.get("RANK") or "0"
        if not raw.isdigit():
            raise ConfigError(f"REPLICA_GROUP_ID/RANK={raw!r}: pass replica= (an integer)")
        replica = int(raw)
    if replicas is None:
        replicas = int(env.get("NUM_REPLICA_GROUPS") or max(replica + 1, 1))
    if not 0 <= replica < replicas:
        raise ConfigError(f"connect(replica={replica}, replicas={replicas}): out of range")
    return WorkerEnv(
        store=store,
        job=job,
        rank=replica,
        world_size=replicas,
        run_dir=run_dir,
        lighthouse="bus" if announces_joins else None,
        secret_file=secret_file or env.get("FASTFT_SECRET_FILE") or None,
    )
