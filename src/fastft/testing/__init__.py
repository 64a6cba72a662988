"""Fakes for users' own tests: the in-memory bus, an in-memory store, a fake clock, and a
store wrapper that counts requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fastft.bus.contract import BusConfig
from fastft.bus.endpoint import BusEndpoint
from fastft.bus.memory import MemoryHub, memory_bus
from fastft.protocol.messages import Role
from fastft.testing.store import CountingStore, MemoryStore

__all__ = ["CountingStore", "FakeClock", "MemoryBus", "MemoryHub", "MemoryStore", "wait_for"]


def wait_for(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.001) -> bool:
    """Poll ``pred`` until it is true or ``timeout_s`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def MemoryBus(
    hub: MemoryHub, job: str = "test", rank: int = 0, incarnation: int = 1, **kw: object
) -> BusEndpoint:
    """An in-memory bus endpoint on ``hub`` (call ``.start()`` or use ``with``)."""
    role = kw.pop("role", Role.WORKER)
    return memory_bus(hub, BusConfig(job=job, rank=rank, incarnation=incarnation, role=role, **kw))  # type: ignore[arg-type]


class FakeClock:
    """A monotonic clock that only moves when told to (seconds)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        with self._lock:
            self._now += seconds
            return self._now
