"""The node's voice in its agent (issue 64; :mod:`fastft.runtime.engine.voice`): the node's
workers hand their arrivals at a formation to the agent over the bus relay's sockets
(:mod:`fastft.bus.relay`), and the agent writes them together and waits for the closed
epoch once for the node (:mod:`fastft.bus.relayvoice` is the workers' side and the wire).

One thread of its own writes the batches (the relay's thread only queues what comes up),
and one thread per epoch waits for it, each over a store client of its own: a wait that
blocks holds up no write, no lease and no bus frame.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from fastft.bus.relayvoice import answer
from fastft.runtime.engine.formation import Arrival
from fastft.runtime.engine.voice import Batch, Batches, NodeVoice

__all__ = ["AgentVoice"]

log = logging.getLogger(__name__)

_MAX_WAIT_S = 30.0
"""The longest wait for an epoch a worker may ask for."""


class AgentVoice:
    """Serves ``hub``'s clients (the node's workers) over ``store`` (the agent's signed
    store; cloned for its own thread and waits). ``expected()``: how many of the node's
    workers run now (a batch goes out once that many arrived, or its window ran out)."""

    def __init__(self, hub: Any, store: Any, keys: Any, expected: Callable[[], int]) -> None:
        self.hub = hub
        self.store = store
        self.keys = keys
        self.expected = expected
        self.batches = Batches()
        self.bad = 0
        """Requests that could not be read (logged, counted, not acted on)."""
        self.written = 0
        """Arrivals written for the node's workers."""
        self._q: queue.Queue[tuple[Any, dict[str, Any]] | None] = queue.Queue()
        self._asked: dict[tuple[int, int], Any] = {}
        """(epoch, rank) -> the client to answer once its arrival is written."""
        self._lock = threading.Lock()
        self._listeners: dict[int, set[Any]] = {}
        """Epoch -> the clients waiting for it (answered when it closes or the wait runs out)."""
        self._waiting: set[int] = set()
        self._voice: NodeVoice | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastft-voice", daemon=True)

    def start(self) -> AgentVoice:
        self.hub.on_frame = self.on_frame
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._q.put(None)

    # --- the relay's thread --------------------------------------------------------------------
    def on_frame(self, client: Any, raw: bytes) -> None:
        """A request from one of the node's workers: checked here, queued for the voice's
        thread (a malformed one is logged and counted, never acted on)."""
        try:
            got = json.loads(raw)
            op = got["op"]
            int(got["epoch"])
            if op == "arrive":
                Arrival.from_json(got["arrival"])  # (it must read as an arrival)
                int(got["rank"])
            elif op == "wait":
                float(got["wait_s"])
            else:
                raise ValueError(f"unknown op {op!r}")
        except (ValueError, KeyError, TypeError) as e:
            self.bad += 1
            log.warning("node voice: a request that does not read (%s): dropped", e)
            return
        self._q.put((client, got))

    # --- the voice's thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._voice = NodeVoice(self.store.clone(), self.keys)
        except Exception as e:  # noqa: BLE001 - the workers then write for themselves
            log.warning("node voice: no store client (%s): the workers write their arrivals", e)
            return
        while not self._stopped.is_set():
            due = self.batches.next_due()
            timeout = None if due is None else max(0.0, due - time.monotonic())
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is not None:
                client, req = item
                if req["op"] == "arrive":
                    self._arrive(client, req)
                else:
                    self._wait(client, int(req["epoch"]), float(req["wait_s"]))
            for batch in self.batches.due(time.monotonic()):
                self._write(batch)

    def _arrive(self, client: Any, req: dict[str, Any]) -> None:
        epoch, rank = int(req["epoch"]), int(req["rank"])
        self._asked[(epoch, rank)] = client
        batch = self.batches.add(epoch, rank, req["arrival"], time.monotonic(), self.expected())
        if batch is not None:
            self._write(batch)

    def _write(self, batch: Batch) -> None:
        assert self._voice is not None
        try:
            first = self._voice.write(batch)
        except Exception as e:  # noqa: BLE001 - unanswered, each worker writes its own
            log.warning("node voice: writing %d arrivals at epoch %d failed: %s",
                        len(batch.arrivals), batch.epoch, e)  # fmt: skip
            for r in batch.arrivals:
                self._asked.pop((batch.epoch, r), None)
            return
        self.written += len(batch.arrivals)
        for r in batch.arrivals:
            client = self._asked.pop((batch.epoch, r), None)
            if client is not None:
                self.hub.send_to(
                    client, answer(op="first", epoch=batch.epoch, rank=r, first=r == first)
                )
        for key in [k for k in self._asked if k[0] < batch.epoch - 2]:
            del self._asked[key]  # (asked long ago, never written: its worker went on)

    def _wait(self, client: Any, epoch: int, wait_s: float) -> None:
        with self._lock:
            self._listeners.setdefault(epoch, set()).add(client)
            if epoch in self._waiting:
                return
            self._waiting.add(epoch)
        wait_s = min(max(wait_s, 0.01), _MAX_WAIT_S)
        threading.Thread(
            target=self._await, args=(epoch, wait_s), name="fastft-voice-wait", daemon=True
        ).start()

    def _await(self, epoch: int, wait_s: float) -> None:
        """One wait for the node (a client of its own), then every listener answered."""
        change: bytes | None = None
        try:
            store = self.store.clone()
            try:
                change = NodeVoice(store, self.keys).wait_change(epoch, wait_s)
            finally:
                _close(store)
        except Exception as e:  # noqa: BLE001 - answered as a wait that ran out
            log.warning("node voice: waiting for epoch %d: %s", epoch, e)
        with self._lock:
            self._waiting.discard(epoch)
            clients = self._listeners.pop(epoch, set())
            for old in [k for k in self._listeners if k < epoch - 2]:
                del self._listeners[old]
        text = change.decode("utf-8", "surrogateescape") if change is not None else None
        for c in clients:
            self.hub.send_to(c, answer(op="closed", epoch=epoch, change=text))


def _close(store: Any) -> None:
    raw = getattr(store, "raw", store)
    close = getattr(raw, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001, S110 - a client that will not close is dropped
            pass
