"""The store clients off the training path: the bus listener's side client (rollback
proposals, the finished mark) and the key collector that deletes decided steps' keys."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from fastft.protocol.keys import JobKeys
from fastft.runtime.engine import decisions

__all__ = ["KeyCollector", "SideClient"]

log = logging.getLogger(__name__)


class SideClient:
    """The store client of the bus listener's thread (rollback proposals, the finished
    mark) and of the key collector, shared under a lock: a store client serialises its
    requests, and the main thread's may be blocked waiting for a decision."""

    def __init__(self, store: Any, keys: JobKeys) -> None:
        self.store = store
        self.keys = keys
        self.lock = threading.Lock()

    def propose_rollback(self, epoch: int, step: int, reason: str) -> str:
        with self.lock:
            return decisions.propose_rollback(self.store, self.keys, epoch, step, reason)

    def job_finished(self) -> bool:
        """Whether a member marked the job finished (it closed after a committed step)."""
        try:
            with self.lock:
                if not self.store.check([self.keys.finished]):
                    return False
                self.store.get(self.keys.finished)  # a forged mark raises ForgedValue
                return True
        except Exception:
            log.debug("could not read the job's finished mark", exc_info=True)
            return False

    def forget(self, epoch: int, step: int) -> None:
        """Delete the keys of decided ``step``."""
        with self.lock:
            decisions.forget(self.store, self.keys, epoch, step)

    def record(self, step: int) -> None:
        """Record that the state after ``step`` is committed (what a total loss reports
        as lost)."""
        with self.lock:
            self.store.set(self.keys.committed, str(step + 1))


_RECORD = (-1, -1)
"""In the collector's queue: write the latest recorded step."""


class KeyCollector:
    """A thread that deletes the keys of decided steps off the training path."""

    def __init__(self, side: SideClient) -> None:
        self._side = side
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._latest: int | None = None
        self._thread = threading.Thread(target=self._run, name="fastft-store-gc", daemon=True)
        self._thread.start()

    def put(self, epoch: int, step: int) -> None:
        """Delete the keys of decided ``step`` of ``epoch``."""
        self._queue.put((epoch, step))

    def record(self, step: int) -> None:
        """Record that ``step`` is committed (applied). At most one write in flight: a
        record not yet written is replaced."""
        with self._lock:
            first = self._latest is None
            self._latest = step
        if first:
            self._queue.put(_RECORD)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=1)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if item is _RECORD:
                    with self._lock:
                        step, self._latest = self._latest, None
                    if step is not None:
                        self._side.record(step)
                    continue
                self._side.forget(*item)
            except Exception:
                log.debug("store gc: could not delete the keys of %s", item, exc_info=True)
