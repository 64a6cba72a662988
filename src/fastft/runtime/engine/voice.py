"""One voice per node (issue 64): a node's agent speaks for its workers in a formation.

A survivor's arrival at the next epoch cost the servers two requests (its arrival key and
the arrivals' counter), and its wait for the closed epoch a third and a fourth (the
blocking read and its answer): four requests a member, 65,540 for one fault at 16,384
members (2.9 s of one TCPStore thread). With a node's voice, a worker hands its arrival
to its agent over the node's bus relay (:mod:`fastft.bus.relay`, a Unix socket); the
agent writes its workers' arrivals together (one multi-set and one count on TCPStore:
the keys and the counter a worker would have written, so the closer reads the same
formation), answers each whether it was the epoch's first, waits for the closed epoch
once for the node, and hands the change to each worker that arrived. The servers see
nodes, not ranks: ~4 requests a node.

* :class:`Batches` (pure): which arrivals go out together: a batch is written when every
  worker the agent expects has arrived, or :data:`WINDOW_S` after its first (a hung or
  dying worker holds up nobody longer).
* :class:`NodeVoice`: the agent's requests, over its store client: :meth:`NodeVoice.write`
  and :meth:`NodeVoice.wait_change`. The scale model runs them as the agent does.
* :class:`VoicePort`: what a worker's :class:`~.survivors.Survivors` asks of its agent. A
  worker whose agent does not answer (gone, or restarting) writes its arrival itself and
  waits on its own, as without a voice.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from fastft.bus.signed import ForgedValue
from fastft.protocol.keys import JobKeys
from fastft.runtime.engine import decisions as d

__all__ = ["WINDOW_S", "Batch", "Batches", "NodeVoice", "VoicePort"]

WINDOW_S = 0.003
"""How long a node's first arrival at an epoch waits for the node's other workers before
the agent writes what it has (the rest go out as they come, in batches of their own)."""


class VoicePort(Protocol):
    """A worker's side of its node's voice (the relay's client in a job; the scale model's
    hand-over in the model)."""

    def arrive(self, epoch: int, rank: int, arrival: str) -> bool | None:
        """Hand this worker's arrival at ``epoch`` to the agent, which writes it; whether
        it was the epoch's first arrival (this worker reminds the missing). None: the
        agent did not answer in time: the worker writes it itself."""
        ...

    def closed(self, epoch: int, timeout_s: float) -> tuple[bool, bytes | None]:
        """The closed epoch's change as the agent read it, waiting up to ``timeout_s``:
        ``(True, raw)``, or ``(True, None)`` when the agent's wait ran out (look
        yourself); ``(False, None)`` when the agent cannot be asked (wait yourself)."""
        ...


@dataclass
class Batch:
    """Arrivals at one epoch that go out together: rank -> the arrival's JSON."""

    epoch: int
    opened: float
    arrivals: dict[int, str] = field(default_factory=dict)


class Batches:
    """The agent's open batches, one per epoch (pure: time comes in as arguments)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.open: dict[int, Batch] = {}
        self.written: dict[int, int] = {}
        """Epoch -> arrivals written for it so far (a late worker's batch is the epoch's)."""

    def add(self, epoch: int, rank: int, arrival: str, now: float, expected: int) -> Batch | None:
        """Take ``rank``'s arrival; the batch to write now, if it is complete (``expected``:
        the node's workers the agent counts on for this epoch, its live ones)."""
        b = self.open.setdefault(epoch, Batch(epoch, now))
        b.arrivals[rank] = arrival
        if self.written.get(epoch, 0) + len(b.arrivals) >= expected:
            return self._take(epoch)
        return None

    def due(self, now: float) -> list[Batch]:
        """The batches whose window ran out (write them as they are)."""
        return [
            self._take(e) for e, b in list(self.open.items()) if now >= b.opened + self.window_s
        ]

    def next_due(self) -> float | None:
        """When the earliest open batch's window runs out (None: none open)."""
        return min((b.opened + self.window_s for b in self.open.values()), default=None)

    def _take(self, epoch: int) -> Batch:
        b = self.open.pop(epoch)
        self.written[epoch] = self.written.get(epoch, 0) + len(b.arrivals)
        for old in [e for e in self.written if e < epoch - 2]:
            del self.written[old]
        return b


class NodeVoice:
    """The agent's requests for its node's formations, over its own (signed) store client
    and a blocking one for the waits (``decision_store``, whose timeout it sets)."""

    def __init__(self, store: Any, keys: JobKeys, decision_store: Any = None) -> None:
        self.store = store
        self.keys = keys
        self.decision_store = decision_store if decision_store is not None else store
        self.reads_many = hasattr(getattr(store, "raw", store), "read_many")
        """NATS: the closer reads arrivals; the first arrival is a compare-and-set."""

    def write(self, batch: Batch) -> int | None:
        """Write ``batch``'s arrivals (the keys a worker writes) and count them; the rank
        that is the epoch's first arrival, if the batch holds it (its lowest)."""
        ranks = sorted(batch.arrivals)
        keys = [self.keys.epoch_arrival(batch.epoch, r) for r in ranks]
        self.store.multi_set(keys, [batch.arrivals[r] for r in ranks])
        me = str(ranks[0])
        if self.reads_many:
            first = d.decide_once(self.store, self.keys.epoch_first(batch.epoch), me) == me
        else:
            n = len(ranks)
            first = int(self.store.add(self.keys.epoch_arrivals(batch.epoch), n)) == n
        return ranks[0] if first else None

    def wait_change(self, epoch: int, timeout_s: float) -> bytes | None:
        """The change of the epoch once closed (one blocking read for the node), or None if
        it did not come within ``timeout_s`` (or came forged)."""
        ds = self.decision_store
        ds.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            return bytes(ds.get(self.keys.epoch_change(epoch)))
        except (dist.DistStoreError, ForgedValue):
            return None
