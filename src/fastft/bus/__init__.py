"""The error bus: contract and backends (TCPStore, the embedded default; in-memory)."""

from fastft.bus.contract import BusConfig, BusStats, Callback, ErrorBus, Transport
from fastft.bus.endpoint import BusEndpoint
from fastft.bus.memory import MemoryHub, memory_bus
from fastft.bus.tcpstore import connect_store, host_store, tcpstore_bus

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
    "memory_bus",
    "tcpstore_bus",
]
