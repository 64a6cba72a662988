"""Contract of the error bus.

The bus is a FIFO message queue with *global puts* and *local gets* (seed design note):
``broadcast(msg)`` puts one message in the queue of every live subscriber except the
sender's own; each subscriber gets its messages in order per publisher, either with
``recv(timeout_s)`` or from a listener thread that calls the registered callbacks.

Guarantees every backend keeps (tests in ``tests/unit/test_bus_*.py`` run against all):

* FIFO per publisher; publishers may broadcast concurrently.
* A publisher that dies half-way through a broadcast stalls no one: each subscriber's queue
  is written independently and no one waits on a publisher.
* A subscriber that stops reading cannot grow memory without bound: once its queue holds
  ``max_queue`` messages and it has not read for ``stale_s`` (TCPStore backend; the memory
  backend evicts at once), or its queue holds ``HARD_CAP x max_queue`` messages, it is
  evicted (dropped from the member set, its queue drained). A subscriber that is reading
  but behind a flooding publisher is not evicted before the hard cap: evicting it would
  cut a live worker off from fault notices. One that finds itself evicted logs it,
  counts it and re-joins.
* Bytes that are not a valid message of this job are logged and counted (``malformed``),
  never delivered and never fatal.
* With the job secret (``BusConfig.secret``) every frame is sealed with a tag
  (:mod:`fastft.protocol.auth`). A frame without a valid tag (``forged``) or seen before
  (``replayed``) is dropped, counted per claimed sender (``rejected_by``) and logged once
  per sender; it never reaches a callback.
* ``close()`` returns within ~100 ms and is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from fastft.errors import ConfigError
from fastft.protocol.auth import JobSecret
from fastft.protocol.messages import Message, Role

__all__ = ["BusConfig", "BusStats", "ErrorBus", "Callback", "Transport"]

Callback = Callable[[Message], None]


HARD_CAP = 16
"""A queue this many times ``max_queue`` long is evicted even if its reader is alive."""


@dataclass(frozen=True)
class BusConfig:
    """Configuration of one bus endpoint.

    ``rank``/``incarnation``/``role`` identify the sender in every message it broadcasts.
    ``max_queue``: a subscriber whose queue reaches this many messages is evicted if it has
    not read for ``stale_s`` seconds (always at ``HARD_CAP`` times as many).
    ``idle_pop_s``: the listener's blocking pop returns after this many seconds without a
    message to check that it is still a member (closing does not wait for it: ``close()``
    wakes the listener at once). ``local_buffer``: messages kept for ``recv()``; older ones
    are dropped (and counted) if nobody calls ``recv()``. ``secret``: the job secret; every
    endpoint of a job needs the same one (None: frames are neither sealed nor checked,
    for tests in one process only).
    """

    job: str
    rank: int
    incarnation: int
    role: Role = Role.WORKER
    subscribe: bool = True
    max_queue: int = 1024
    idle_pop_s: float = 10.0
    stale_s: float = 2.0
    local_buffer: int = 4096
    secret: JobSecret | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.job or "/" in self.job:
            raise ConfigError(f"job id {self.job!r}: use a non-empty id without '/'")
        if self.max_queue < 16:
            raise ConfigError(f"max_queue={self.max_queue}: use at least 16")
        if not 0.05 <= self.stale_s <= 3600:
            raise ConfigError(f"stale_s={self.stale_s}: use 0.05 .. 3600 seconds")
        if not 0.01 <= self.idle_pop_s <= 3600:
            raise ConfigError(f"idle_pop_s={self.idle_pop_s}: use 0.01 .. 3600 seconds")
        if self.local_buffer < 1:
            raise ConfigError(f"local_buffer={self.local_buffer}: use at least 1")


@dataclass
class BusStats:
    """Counters of one endpoint (read them; they only grow)."""

    published: int = 0
    delivered: int = 0
    malformed: int = 0
    dropped_local: int = 0
    callback_errors: int = 0
    evicted_peers: int = 0
    self_evictions: int = 0
    transport_errors: int = 0
    forged: int = 0
    replayed: int = 0
    rejected_by: dict[str, int] = field(default_factory=dict)
    """Forged or replayed frames per claimed sender (``rank R incarnation I role X``)."""
    malformed_samples: list[str] = field(default_factory=list)


@runtime_checkable
class ErrorBus(Protocol):
    """What the runtime, the agent and the CLI use."""

    stats: BusStats

    def start(self) -> ErrorBus: ...

    def broadcast(self, msg: Message) -> Message: ...

    def recv(self, timeout_s: float | None = None) -> Message | None: ...

    def subscribe(self, callback: Callback) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """What a backend provides to :class:`fastft.bus.endpoint.BusEndpoint`.

    ``push_all`` writes one encoded message into every member's queue but ``exclude``;
    ``pop`` blocks up to ``idle_pop_s`` and returns None on timeout; ``wake`` makes a
    blocked ``pop`` of this endpoint return at once.
    ``evictions`` counts subscribers this endpoint evicted.
    """

    @property
    def evictions(self) -> int: ...

    def join(self, label: str) -> str: ...

    def leave(self) -> None: ...

    def is_member(self) -> bool: ...

    def push_all(self, data: bytes) -> int: ...

    def pop(self) -> bytes | None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...
