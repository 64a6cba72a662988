"""The agent's side of the node's bus relay (:class:`HubTransport`): the backend's transport
with a pump thread that hands every frame to the node's :class:`~fastft.bus.relay.RelayHub`
before the agent's own listener gets it (:mod:`fastft.bus.relay` says why)."""

from __future__ import annotations

import contextlib
import queue
import threading

from fastft.bus.contract import Transport
from fastft.bus.endpoint import WAKE
from fastft.bus.relay import RelayHub

__all__ = ["HubTransport"]


class HubTransport:
    """The agent's transport: ``inner`` (the backend's) with a pump thread that hands
    every frame to ``hub`` before the agent's own listener gets it; what the agent
    broadcasts goes to the hub's clients too. Closing it closes the hub."""

    def __init__(self, inner: Transport, hub: RelayHub, idle_pop_s: float) -> None:
        self._inner = inner
        self.hub = hub
        self._idle_pop_s = idle_pop_s
        self._q: queue.SimpleQueue[bytes | Exception | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None

    @property
    def evictions(self) -> int:
        return self._inner.evictions

    def join(self, label: str) -> str:
        sid = self._inner.join(label)
        if self._pump is None:
            self.hub.start()
            self._pump = threading.Thread(target=self._run, name="fastft-bus-pump", daemon=True)
            self._pump.start()
        return sid

    def leave(self) -> None:
        self._inner.leave()

    def is_member(self) -> bool:
        return self._inner.is_member()

    def push_all(self, data: bytes) -> int:
        return self.hub.fan_out(data) + self._inner.push_all(data)

    def pop(self) -> bytes | None:
        try:
            item = self._q.get(timeout=self._idle_pop_s)
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def wake(self) -> None:
        self._q.put(WAKE)

    def close(self) -> None:
        self._stop.set()
        if self._pump is not None:
            with contextlib.suppress(Exception):  # (the store may be gone)
                self._inner.wake()
            self._pump.join(timeout=1.0)
        self.hub.close()
        self._inner.close()

    def _run(self) -> None:
        errors = 0
        while not self._stop.is_set():
            try:
                data = self._inner.pop()
            except Exception as e:
                if self._stop.is_set():
                    return
                errors += 1
                self._q.put(e)  # (the endpoint counts and logs it)
                self._stop.wait(min(1.0, 0.05 * errors))
                continue
            errors = 0
            if data is not None and data != WAKE:
                self.hub.fan_out(data)
            if data != WAKE:
                self._q.put(data)
