"""In-memory bus backend: every endpoint of one :class:`MemoryHub` shares its queues.

For unit tests (the runtime's and users' own); same guarantees as the TCPStore backend
within one process. Shipped as ``fastft.testing.MemoryBus``.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

from fastft.bus.contract import BusConfig
from fastft.bus.endpoint import WAKE, BusEndpoint

__all__ = ["MemoryHub", "MemoryTransport", "memory_bus"]


class MemoryHub:
    """The shared "store" of in-memory endpoints."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.queues: dict[str, deque[bytes]] = {}
        self.labels: dict[str, str] = {}
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return str(next(self._ids))


class MemoryTransport:
    def __init__(self, hub: MemoryHub, config: BusConfig) -> None:
        self.hub = hub
        self.config = config
        self.id: str | None = None
        self.evictions = 0

    def join(self, label: str) -> str:
        with self.hub.lock:
            self.id = self.hub.new_id()
            self.hub.queues[self.id] = deque()
            self.hub.labels[self.id] = label
            return self.id

    def leave(self) -> None:
        with self.hub.lock:
            if self.id is not None:
                self.hub.queues.pop(self.id, None)
                self.hub.labels.pop(self.id, None)
            self.hub.lock.notify_all()

    def is_member(self) -> bool:
        with self.hub.lock:
            return self.id in self.hub.queues

    def push_all(self, data: bytes) -> int:
        n = 0
        with self.hub.lock:
            for sub, q in list(self.hub.queues.items()):
                if sub == self.id:
                    continue
                if len(q) >= self.config.max_queue:
                    self.hub.queues.pop(sub)
                    self.hub.labels.pop(sub, None)
                    self.evictions += 1
                    continue
                q.append(data)
                n += 1
            self.hub.lock.notify_all()
        return n

    def pop(self) -> bytes | None:
        with self.hub.lock:
            q = self.hub.queues.get(self.id or "")
            if q is None:
                return None
            if not q:
                self.hub.lock.wait(self.config.idle_pop_s)
                q = self.hub.queues.get(self.id or "")
                if not q:
                    return None
            return q.popleft()

    def wake(self) -> None:
        with self.hub.lock:
            q = self.hub.queues.get(self.id or "")
            if q is not None:
                q.append(WAKE)
            self.hub.lock.notify_all()

    def close(self) -> None:
        pass


def memory_bus(hub: MemoryHub, config: BusConfig) -> BusEndpoint:
    """An endpoint on ``hub`` (not started)."""
    return BusEndpoint(config, MemoryTransport(hub, config))
