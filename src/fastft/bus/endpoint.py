"""The backend-independent half of a bus endpoint: stamping, encoding, decoding, counting,
the listener thread and the callbacks. Backends supply a :class:`Transport`."""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import replace

from fastft.bus.contract import BusConfig, BusStats, Callback, Transport
from fastft.errors import BusClosed, ProtocolError
from fastft.protocol.auth import NONCE_BYTES, Forged, MessageAuth, ReplayGuard
from fastft.protocol.codec import claimed_sender, decode, encode
from fastft.protocol.messages import Message

__all__ = ["BusEndpoint", "WAKE"]

log = logging.getLogger(__name__)

WAKE = b"\x00fastft-wake"
"""Sentinel a closing endpoint pushes into its own queue to end a blocking pop."""

_MAX_SAMPLES = 8
_MAX_REJECTING = 256
"""Claimed senders counted one by one; more are counted together as ``others``."""


class BusEndpoint:
    """One process's (or thread's) attachment to the bus.

    ``start()`` joins the subscriber set (if ``config.subscribe``) and starts the listener
    thread, which decodes each message, hands it to every callback (in the listener thread,
    in order) and buffers it for :meth:`recv`. A callback that raises is logged and counted;
    it never stops the listener.
    """

    def __init__(self, config: BusConfig, transport: Transport) -> None:
        self.config = config
        self.stats = BusStats()
        self._transport = transport
        self._seq = itertools.count(1)
        # Held from the sequence number to the push: two threads that stamped in one order
        # and pushed in the other would have the later frame rejected as a replay.
        self._send_lock = threading.Lock()
        self._callbacks: list[Callback] = []
        self._buffer: deque[Message] = deque()
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self.subscriber_id: str | None = None
        self._auth = MessageAuth(config.secret) if config.secret is not None else None
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._replays = ReplayGuard(time.time())

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        """What this endpoint sends and receives through (a relay's client, a store's)."""
        return self._transport

    def start(self) -> BusEndpoint:
        if self._closed.is_set():
            raise BusClosed("bus endpoint is closed")
        if self._started:
            return self
        self._started = True
        if self.config.subscribe:
            self.subscriber_id = self._transport.join(self._label())
            self._thread = threading.Thread(
                target=self._listen, name=f"fastft-bus-{self.subscriber_id}", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Leave the bus and stop the listener. Idempotent; returns within ~100 ms."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            try:
                self._transport.wake()
            except Exception:  # the store may already be gone
                log.debug("bus wake failed", exc_info=True)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=1.0)
        try:
            if self.subscriber_id is not None:
                self._transport.leave()
        except Exception:
            log.debug("bus leave failed", exc_info=True)
        finally:
            self._transport.close()

    def __enter__(self) -> BusEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # --- publishing ------------------------------------------------------------------------
    def stamp(self, msg: Message) -> Message:
        """Fill in the sender's next sequence number and the wall time (the caller holds
        ``_send_lock`` until the message is pushed)."""
        return replace(msg, seq=next(self._seq), wall_time=time.time())

    def broadcast(self, msg: Message) -> Message:
        """Put ``msg`` (stamped) into every other subscriber's queue; returns what was sent."""
        if self._closed.is_set():
            raise BusClosed("bus endpoint is closed")
        if msg.job != self.config.job:
            raise ProtocolError(f"message of job {msg.job!r} on the bus of {self.config.job!r}")
        with self._send_lock:  # frames leave in the order of their sequence numbers
            sent = self.stamp(msg)
            data = encode(sent)
            if self._auth is not None:
                data = self._auth.seal(data, self._nonce)
            self._transport.push_all(data)
        self.stats.published += 1
        self.stats.evicted_peers = self._transport.evictions
        return sent

    def publish_raw(self, data: bytes) -> None:
        """Put raw bytes on the bus as they are (tests and protocol fuzzing only)."""
        if self._closed.is_set():
            raise BusClosed("bus endpoint is closed")
        self._transport.push_all(bytes(data))

    # --- receiving -------------------------------------------------------------------------
    def subscribe(self, callback: Callback) -> None:
        """Call ``callback(msg)`` in the listener thread for every message from now on."""
        if not self.config.subscribe:
            raise ValueError("this endpoint was configured with subscribe=False")
        self._callbacks.append(callback)

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next buffered message, waiting up to ``timeout_s`` seconds (None: forever);
        None on timeout. Raises BusClosed once closed and drained."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._buffer:
                if self._closed.is_set():
                    raise BusClosed("bus endpoint is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._buffer.popleft()

    def _listen(self) -> None:
        transport = self._transport
        while not self._closed.is_set():
            try:
                data = transport.pop()
            except Exception as e:
                if self._closed.is_set():
                    return
                self.stats.transport_errors += 1
                log.warning("bus listener: transport error (%s); retrying", e)
                self._closed.wait(min(1.0, 0.05 * self.stats.transport_errors))
                continue
            if data is None:
                if not self._closed.is_set() and not transport.is_member():
                    old = self.subscriber_id
                    try:
                        self.subscriber_id = transport.join(self._label())
                    except Exception as e:
                        self.stats.transport_errors += 1
                        log.warning("bus listener: could not join again (%s); retrying", e)
                        self._closed.wait(min(1.0, 0.05 * self.stats.transport_errors))
                        continue
                    self.stats.self_evictions += 1
                    log.error(
                        "bus subscriber %s was evicted (stopped reading?); re-joined as %s, "
                        "messages in between are lost",
                        old,
                        self.subscriber_id,
                    )
                continue
            if data == WAKE:
                continue
            self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        nonce = b""
        if self._auth is not None:
            try:
                data, nonce = self._auth.open(data)
            except Forged as e:
                self.stats.forged += 1
                self._reject(claimed_sender(data), f"forged: {e}")
                return
        try:
            msg = decode(data, job=self.config.job)
        except ProtocolError as e:
            self.stats.malformed += 1
            if len(self.stats.malformed_samples) < _MAX_SAMPLES:
                self.stats.malformed_samples.append(str(e))
            log.warning("bus: dropped a malformed message (%d so far): %s", self.stats.malformed, e)
            return
        if self._auth is not None:
            why = self._replays.check(
                (int(msg.role), msg.rank, msg.incarnation, nonce), msg.seq, msg.wall_time
            )
            if why is not None:
                self.stats.replayed += 1
                self._reject(claimed_sender(data), f"replayed: {why}")
                return
        self.stats.delivered += 1
        for cb in list(self._callbacks):
            try:
                cb(msg)
            except Exception:
                self.stats.callback_errors += 1
                log.exception("bus callback %r failed on %s", cb, type(msg).__name__)
        with self._cond:
            if len(self._buffer) >= self.config.local_buffer:
                self._buffer.popleft()
                self.stats.dropped_local += 1
            self._buffer.append(msg)
            self._cond.notify()

    def _reject(self, sender: str, why: str) -> None:
        """Count a frame that is not acted on; log the first one of each claimed sender."""
        by = self.stats.rejected_by
        if sender not in by and len(by) >= _MAX_REJECTING:
            sender = "others"
        by[sender] = by.get(sender, 0) + 1
        if by[sender] == 1:
            log.error(
                "bus: dropped a frame that claims to be from %s (%s); further ones from it are "
                "counted, not logged. Is something without the job secret writing to the "
                "job's store?",
                sender,
                why,
            )

    def _label(self) -> str:
        c = self.config
        return f"{c.rank}.{c.incarnation}.{int(c.role)}"
