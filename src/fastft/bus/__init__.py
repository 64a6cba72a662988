"""The error bus and the control plane's store: contract and backends (TCPStore, the
embedded default; NATS, replicated; in-memory for tests)."""

from __future__ import annotations

from typing import Any

from fastft.bus.contract import BusConfig, BusStats, Callback, ErrorBus, Transport
from fastft.bus.endpoint import BusEndpoint
from fastft.bus.memory import MemoryHub, memory_bus
from fastft.bus.nats import is_nats
from fastft.bus.tcpstore import connect_store as _connect_tcpstore
from fastft.bus.tcpstore import host_store, tcpstore_bus

__all__ = [
    "BusConfig",
    "BusEndpoint",
    "BusStats",
    "Callback",
    "ErrorBus",
    "MemoryHub",
    "Transport",
    "connect_store",
    "host_store",
    "is_nats",
    "memory_bus",
    "open_bus",
    "tcpstore_bus",
]


def connect_store(
    address: str, timeout_s: float = 30.0, wait_s: float = 0.0, torch_free: bool = False
) -> Any:
    """The job's store at ``address``: ``HOST:PORT`` (a TCPStore) or ``nats://...`` URLs
    (the NATS control plane). Raises StoreUnreachable with one line if it cannot.
    ``torch_free``: a client that imports no torch (the operator's commands: enough for
    the bus, not for a process group's rendezvous)."""
    if is_nats(address) and torch_free:
        from fastft.bus.nats import connect_kv

        return connect_kv(address, timeout_s=timeout_s, wait_s=min(wait_s, 5.0))
    if is_nats(address):
        from fastft.bus.natsstore import connect_nats

        return connect_nats(address, timeout_s=timeout_s, wait_s=min(wait_s, 5.0))
    return _connect_tcpstore(address, timeout_s=timeout_s, wait_s=wait_s, torch_free=torch_free)


def open_bus(store: Any, config: BusConfig) -> BusEndpoint:
    """An endpoint (not started) on the bus that goes with ``store``'s backend."""
    from fastft.bus.nats import NatsKV, nats_bus

    if isinstance(store, NatsKV):
        return nats_bus(store, config)
    return tcpstore_bus(store, config)
