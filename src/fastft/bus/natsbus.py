"""The error bus on core NATS: one subject per job (``fastft.<job>.bus``), one publish per
broadcast, which the servers fan out; FIFO per publisher. The servers cut off a subscriber
that stops reading (slow consumer). The store's side of the NATS plane is
:mod:`fastft.bus.nats`."""

from __future__ import annotations

import logging
import queue
from typing import Any

from fastft.bus.contract import BusConfig
from fastft.bus.endpoint import WAKE
from fastft.bus.nats import NatsKV, escape_key
from fastft.bus.natsio import run

__all__ = ["NatsTransport"]

log = logging.getLogger(__name__)

# --- the bus --------------------------------------------------------------------------------
_FROM = "Fastft-From"
"""Header naming the publishing endpoint, so that it skips its own messages."""


class NatsTransport:
    """The error bus on core NATS: one subject per job, fanned out by the servers."""

    def __init__(self, store: NatsKV, config: BusConfig) -> None:
        self.config = config
        self._conn = store.conn
        self.subject = f"fastft.{escape_key(config.job).replace('/', '_')}.bus"
        self._queue: queue.SimpleQueue[bytes] | None = None
        self._sub: Any = None
        self.id: str | None = None
        self.evictions = 0
        self._timeout_s = store.timeout_s

    def join(self, label: str) -> str:
        nc = self._conn.nc
        me = self.id = f"{label}@{id(self):x}"
        q: queue.SimpleQueue[bytes] = queue.SimpleQueue()

        async def on_msg(msg: Any) -> None:
            if msg.headers and msg.headers.get(_FROM) == me:
                return  # the servers echo a publisher's own messages
            q.put_nowait(msg.data)  # the listener thread blocks on q itself

        async def subscribe() -> Any:
            sub = await nc.subscribe(self.subject, cb=on_msg, pending_msgs_limit=1 << 20)
            await nc.flush()
            return sub

        self._queue = q
        self._sub = run(subscribe(), self._timeout_s)
        return me

    def leave(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                run(sub.unsubscribe(), 2.0)
            except Exception:
                log.debug("nats: unsubscribe failed", exc_info=True)

    def is_member(self) -> bool:
        return self._sub is not None

    def push_all(self, data: bytes) -> int:
        nc = self._conn.nc

        headers = {_FROM: self.id} if self.id else None

        async def publish() -> None:
            await nc.publish(self.subject, data, headers=headers)

        run(publish(), self._timeout_s)
        return 1

    def pop(self) -> bytes | None:
        q = self._queue
        assert q is not None
        try:
            return q.get(timeout=self.config.idle_pop_s)
        except queue.Empty:
            return None

    def wake(self) -> None:
        q = self._queue
        if q is not None:
            q.put_nowait(WAKE)

    def close(self) -> None:
        self.leave()
