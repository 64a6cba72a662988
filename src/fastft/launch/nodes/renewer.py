"""Lease renewals that a lost packet does not hold up (issue 60, case 6).

A TCPStore client is one TCP connection. A renewal lost in a flap of the node's path is
sent again only after TCP's retransmission timeout (200 ms at least on Linux, doubling on
each loss), and every call after it waits behind it on the same connection, the lease's
own reads included: a 100 ms flap stalled the counter for 400 ms, past the 300 ms lease,
and the node was declared lost. Here the renewals keep a clock of their own (not the
lease's rounds, whose reads wait out the same retransmissions) and each goes out on a
connection with nothing in flight: :data:`RENEWERS` threads, each with a store client of
its own, take them from one queue; one stuck in a retransmission leaves the next renewal
to an idle one, which reaches the store as soon as the path is back. The same renewals a
second as before; :data:`RENEWERS` connections a node instead of one.

On the NATS control plane the renewals are core-NATS beats (:mod:`fastft.launch.nodes.beats`),
each connection held to a server of its own: the same idle-first hand-out also leaves a
server that stopped answering to the others.
"""

from __future__ import annotations

import datetime
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RENEWERS", "Renewer", "store_sends"]

log = logging.getLogger(__name__)

RENEWERS = 3
"""Connections a node renews its lease on: a flap of F ms leaves about F / heartbeat + 1
of them waiting for a retransmission; with the defaults (100 ms) 3 cover a flap as long
as the lease."""


def store_sends(store: Any, key: str, clients: int, timeout_s: float) -> list[Callable[[], Any]]:
    """Renewals of the counter ``key`` (``add(key, 1)``), one per store client of its own
    cloned from ``store`` (each call waits at most ``timeout_s``)."""
    out: list[Callable[[], Any]] = []
    for _ in range(clients):
        client = store.clone()
        client.set_timeout(datetime.timedelta(seconds=timeout_s))
        out.append(functools.partial(client.add, key, 1))
    return out


class Renewer:
    """Renew every ``period_s`` through ``sends`` (one blocking call per connection, e.g.
    :func:`store_sends`): each renewal goes to whichever connection is idle, and never
    waits (one renewal waits at most: when every connection is stuck, the first one freed
    sends it)."""

    def __init__(self, sends: list[Callable[[], Any]], *, period_s: float) -> None:
        self.period_s = period_s
        self.ticks = 0
        """Renewals handed over."""
        self._todo: queue.Queue[int] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(s,), name="fastft-lease-renew", daemon=True)
            for s in sends
        ]
        self._threads.append(
            threading.Thread(target=self._tick, name="fastft-lease-tick", daemon=True)
        )

    def start(self) -> Renewer:
        for t in self._threads:
            t.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._todo.put_nowait(1)
            except queue.Full:
                pass  # (every connection is stuck and one renewal waits already)
            self.ticks += 1

    def _run(self, send: Callable[[], Any]) -> None:
        while not self._stop.is_set():
            try:
                self._todo.get(timeout=self.period_s)
            except queue.Empty:
                continue
            try:
                send()
            except Exception as e:  # (the lease's own rounds judge the store's loss)
                log.debug("lease renewal failed: %s", e)
                try:  # another connection sends it; this one sits the next one out (one
                    self._todo.put_nowait(1)  # failing at once would swallow most of them)
                except queue.Full:
                    pass
                self._stop.wait(self.period_s)

    def close(self) -> None:
        self._stop.set()
