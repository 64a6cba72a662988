"""The node's voice in its agent (issue 64; :mod:`fastft.runtime.engine.voice`): the node's
workers hand their arrivals at a formation to the agent over the bus relay's sockets
(:mod:`fastft.bus.relay`), and the agent writes them together and waits for the closed
epoch once for the node (:mod:`fastft.bus.relayvoice` is the workers' side and the wire).

One thread of its own writes the batches (the relay's thread only queues what comes up),
and another waits for the closed epochs, each over a store client of its own made at the
start: a wait that blocks holds up no write, no lease and no bus frame.
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
        self._cv = threading.Condition()
        self._listeners: dict[int, set[Any]] = {}
        """Epoch -> the clients waiting for it (answered when it closes or the wait runs out)."""
        self._want: dict[int, float] = {}
        """Epochs asked for and not yet waited for -> how long to wait."""
        self._voice: NodeVoice | None = None
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name="fastft-voice", daemon=True),
            threading.Thread(target=self._waits, name="fastft-voice-waits", daemon=True),
        ]

    def start(self) -> AgentVoice:
        self.hub.on_frame = self.on_frame
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._q.put(None)
        with self._cv:
            self._cv.notify_all()

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
        with self._cv:
            self._listeners.setdefault(epoch, set()).add(client)
            self._want[epoch] = min(max(wait_s, 0.01), _MAX_WAIT_S)
            self._cv.notify()

    def _waits(self) -> None:
        """The node's waits for closed epochs, one at a time, the newest asked for first,
        over a client made at the start (a connection opened during a formation cost the
        TCPStore's one thread a stall of 5 s at 256 members: it blocks the formation)."""
        try:
            voice = NodeVoice(self.store.clone(), self.keys)
        except Exception as e:  # noqa: BLE001 - the workers then wait for themselves
            log.warning("node voice: no store client for its waits (%s)", e)
            return
        while not self._stopped.is_set():
            with self._cv:
                if not self._want:
                    self._cv.wait(0.5)
                    continue
                epoch = max(self._want)
                wait_s = self._want.pop(epoch)
                stale = [k for k in self._want if k < epoch]  # (answered: look yourselves)
                for k in stale:
                    del self._want[k]
            for k in stale:
                self._answer(k, None)
            change: bytes | None = None
            try:
                change = voice.wait_change(epoch, wait_s)
            except Exception as e:  # noqa: BLE001 - answered as a wait that ran out
                log.warning("node voice: waiting for epoch %d: %s", epoch, e)
            self._answer(epoch, change)

    def _answer(self, epoch: int, change: bytes | None) -> None:
        """Every worker that waits for ``epoch``: its change, or None (the wait ran out)."""
        with self._cv:
            clients = self._listeners.pop(epoch, set())
            for old in [k for k in self._listeners if k < epoch - 2]:
                del self._listeners[old]
        text = change.decode("utf-8", "surrogateescape") if change is not None else None
        for c in clients:
            self.hub.send_to(c, answer(op="closed", epoch=epoch, change=text))
