"""The error bus and the control plane's store: contract and backends (TCPStore, the
embedded default; NATS, replicated; in-memory for tests)."""

from __future__ import annotations

from typing import Any

from fastft.bus.contract import BusConfig, BusStats, Callback, ErrorBus, Transport
from fastft.bus.endpoint import BusEndpoint
from fastft.bus.memory import MemoryHub, memory_bus
from fastft.bus.nats import is_nats
from fastft.bus.relay import RelayHub
from fastft.bus.tcpstore import StoreTransport, host_store, tcpstore_bus
from fastft.bus.tcpstore import connect_store as _connect_tcpstore

__all__ = [
    "BusConfig",
    "BusEndpoint",
    "BusStats",
    "Callback",
    "ErrorBus",
    "MemoryHub",
    "RelayHub",
    "Transport",
    "connect_store",
    "host_store",
    "is_nats",
    "memory_bus",
    "node_voice",
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


def open_bus(
    store: Any, config: BusConfig, *, relay: str | None = None, hub: RelayHub | None = None
) -> BusEndpoint:
    """An endpoint (not started) on the bus that goes with ``store``'s backend.

    ``relay``: the address of this node's relay hub (a worker under ``fastft run``): the
    endpoint receives from it instead of subscribing to the store itself. ``hub``: this
    endpoint is its node's subscriber and relays every frame to the hub's clients (the
    agent); the endpoint owns the hub from then on and closes it."""
    transport = _transport(store, config)
    if relay is not None:
        from fastft.bus.relayed import RelayedTransport

        return BusEndpoint(config, RelayedTransport(transport, relay, config.idle_pop_s))
    if hub is not None:
        from fastft.bus.hubtransport import HubTransport

        return BusEndpoint(config, HubTransport(transport, hub, config.idle_pop_s))
    return BusEndpoint(config, transport)


def node_voice(endpoint: BusEndpoint) -> Any:
    """The node's voice (:class:`~fastft.bus.relayvoice.RelayVoice`) for a worker that
    hears the bus through its agent's relay; None for any other endpoint."""
    from fastft.bus.relayed import RelayedTransport

    transport = endpoint.transport
    if not isinstance(transport, RelayedTransport):
        return None
    from fastft.bus.relayvoice import RelayVoice

    return RelayVoice(transport)


def _transport(store: Any, config: BusConfig) -> Transport:
    from fastft.bus.nats import NatsKV
    from fastft.bus.natsbus import NatsTransport

    if isinstance(store, NatsKV):
        return NatsTransport(store, config)
    return StoreTransport(store, config)
