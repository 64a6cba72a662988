"""A torchft replica under ``fastft run``: the ``Manager`` arguments ``ManagerFFT`` sets,
and the tap on torchft's quorum client (reports each quorum, answers leased ones)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from fastft.integrations.torchft.quorum import fastft_replica_id

__all__ = ["QuorumTap", "advertised_host", "under_fastft_kwargs"]


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
        q = self._client._quorum(*args, **kwargs)
        self._on_quorum(q)
        return q

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def advertised_host(env: Mapping[str, str]) -> str:
    """The host name torchft advertises: loopback for a single-node job."""
    store = env.get("FASTFT_STORE", "")
    return "127.0.0.1" if store.startswith("127.0.0.1:") else socket.gethostname()


def under_fastft_kwargs(
    kwargs: dict[str, Any], env: Mapping[str, str], rank: int, incarnation: int
) -> Any:
    """What ``ManagerFFT`` changes in torchft's ``Manager`` arguments under ``fastft run``
    (in place): the replica id names the life (``fastft-<rank>-<incarnation>/<id>``), the
    host is loopback for a single-node job, the heartbeat is 1 s (the bus, not the
    lighthouse's heartbeat timeout, reports a dead replica), and a replica group of one
    process without a store gets one of its own. Returns that store's server, or None."""
    kwargs["replica_id"] = fastft_replica_id(
        rank, incarnation, str(kwargs.get("replica_id") or env.get("REPLICA_GROUP_ID", rank))
    )
    kwargs.setdefault("hostname", advertised_host(env))
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
