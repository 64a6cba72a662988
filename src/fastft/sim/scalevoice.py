"""A node's voice in the scale model (:mod:`fastft.runtime.engine.voice`): the node's agent
as a simulated process that carries out the real :class:`Batches` and :class:`NodeVoice`
for its workers, whose :class:`~fastft.runtime.engine.survivors.Survivors` ask it through
the :class:`VoicePort` it is to them. A hand-over between a worker and its agent (a
relay's Unix socket) takes :data:`HOP_S` each way."""

from __future__ import annotations

from typing import Any

import greenlet

from fastft.runtime.engine.voice import Batch, Batches, NodeVoice

__all__ = ["HOP_S", "ModelVoice"]

HOP_S = 0.0002
"""A frame's hop between a node's agent and one of its workers (a Unix socket)."""


class ModelVoice:
    """Node ``node``'s agent; ``expected``: its workers that arrive (its live ones)."""

    def __init__(self, job: Any, node: int, expected: int, wait_s: float) -> None:
        self.hub = job.hub
        client = job.n + node  # (an agent's own clients, homed like any other's)
        self.voice = NodeVoice(job.client(client), job.keys, job.client(client, wait_s))
        self.batches = Batches()
        self.expected = expected
        self.wait_s = wait_s
        self._asked: dict[int, Any] = {}
        """Rank -> its worker, waiting for the answer to its arrival."""
        self._waiters: dict[int, list[Any]] = {}
        self._changes: dict[int, bytes | None] = {}
        self._waiting: set[int] = set()

    # --- the workers' side (VoicePort) ---------------------------------------------------------
    def arrive(self, epoch: int, rank: int, arrival: str) -> bool | None:
        hub = self.hub
        self._asked[rank] = greenlet.getcurrent()
        hub.sleep(HOP_S)
        batch = self.batches.add(epoch, rank, arrival, hub.now, self.expected)
        if batch is not None:
            hub.spawn(hub.now, lambda: self._write(batch))
        else:
            due = self.batches.next_due()
            hub.spawn(due if due is not None else hub.now, self._due)
        got = hub.suspend()
        return bool(got)

    def closed(self, epoch: int, timeout_s: float) -> tuple[bool, bytes | None]:
        hub = self.hub
        if epoch in self._changes:
            hub.sleep(HOP_S)
            return True, self._changes[epoch]
        self._waiters.setdefault(epoch, []).append(greenlet.getcurrent())
        if epoch not in self._waiting:  # (its last wait ran out: another)
            self._waiting.add(epoch)
            hub.spawn(hub.now, lambda: self._wait(epoch))
        return True, hub.suspend()

    # --- the agent's own processes -------------------------------------------------------------
    def _due(self) -> None:
        for batch in self.batches.due(self.hub.now):
            self._write(batch)

    def _write(self, batch: Batch) -> None:
        first = self.voice.write(batch)
        for r in batch.arrivals:
            self.hub.resume_at(self.hub.now + HOP_S, self._asked.pop(r), r == first)
        if batch.epoch not in self._waiting and batch.epoch not in self._changes:
            self._waiting.add(batch.epoch)
            self._wait(batch.epoch)

    def _wait(self, epoch: int) -> None:
        raw = self.voice.wait_change(epoch, self.wait_s)
        self._waiting.discard(epoch)
        if raw is not None:
            self._changes[epoch] = raw
        for g in self._waiters.pop(epoch, []):
            self.hub.resume_at(self.hub.now + HOP_S, g, raw)
