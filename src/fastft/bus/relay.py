"""The node's bus relay: one subscriber per node instead of one per worker.

With every worker subscribed to the store's bus, a broadcast cost the store one push and
one pop per worker, on its one thread (~67 µs each: ~69 ms to the last of 1,024 workers).
With the relay, a node's agent is the node's one subscriber: it pops each frame from the
store (or NATS) and writes it as it is (sealed: the workers check every tag themselves) to
each of its workers over a Unix socket. A broadcast then costs the store one push per node
(docs/architecture.md, "The bus relay").

* :class:`RelayHub` (in the agent) listens on an abstract Unix socket, accepts the node's
  processes (only its own user's: ``SO_PEERCRED``) and writes each frame to each of them
  without ever blocking: a worker that does not read gets its frames queued and is cut
  off as a store subscriber would be evicted (``max_queue`` frames after ``stale_s``
  without progress, or ``HARD_CAP x max_queue`` at once); it then connects again and
  counts a self-eviction.
* :class:`~fastft.bus.hubtransport.HubTransport` (the agent's endpoint) is the backend's transport with a pump
  thread that pops each frame, hands it to the hub first and then to the agent's own
  listener (whose callbacks may be slow). What the agent broadcasts reaches its workers
  through the hub too.
* :class:`~fastft.bus.relayed.RelayedTransport` is a worker's side.

Wire: the client sends its label and a newline; the hub registers it and answers with an
empty frame (the join is then complete: every frame the agent pops after it reaches the
client); then frames, each a 4-byte big-endian length and the bytes. A client's own
frames up the socket are its requests to the node's voice (:mod:`fastft.launch.nodes.voice`:
its arrivals at a formation), handed to :attr:`RelayHub.on_frame`; the answers come down
as frames that begin with :data:`VOICE`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fastft.bus.contract import HARD_CAP

__all__ = ["HEADER", "VOICE", "HubStats", "RelayHub", "sockaddr"]

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
VOICE = b"\xfffastft-voice\n"
"""The start of a frame from the node's voice to one worker (no bus frame starts so)."""
MAX_UP = 1 << 20
"""A longer frame up a client's socket means it is out of step: the client is dropped."""
HELLO_MAX = 256
"""Longest label a client may send (bytes, the newline included)."""
HELLO_S = 2.0
"""How long the hub waits for a connected client's label, and a client for the hub's
answer (seconds)."""
_TICK_S = 0.25
"""The hub's thread checks for clients that stopped reading at least this often."""


def sockaddr(address: str) -> str | bytes:
    """``@name``: Linux's abstract namespace (no file to leave behind; per network
    namespace, which a node's agent and workers share); anything else: a path."""
    return b"\0" + address[1:].encode() if address.startswith("@") else address


@dataclass
class HubStats:
    """Counters of one hub (they only grow, but ``clients``)."""

    clients: int = 0
    accepted: int = 0
    refused: int = 0
    frames: int = 0
    queued: int = 0
    """Writes that could not go out at once (the client's socket buffer was full)."""
    cut_off: int = 0
    """Clients dropped because they stopped reading."""


class _Client:
    __slots__ = ("sock", "label", "hello", "up", "since", "backlog", "progress_t", "mask")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.label = ""
        self.hello = bytearray()
        self.up = bytearray()
        """What the client sent up since its hello: its frames to the node's voice."""
        self.since = time.monotonic()
        self.backlog: deque[memoryview] = deque()
        self.progress_t = self.since
        self.mask = selectors.EVENT_READ


class RelayHub:
    """The agent's end of the relay: ``start()`` listens and serves in one thread;
    :meth:`fan_out` (any thread) writes a frame to every client.

    ``max_queue``/``stale_s``: as :class:`~fastft.bus.contract.BusConfig`'s, per client.
    ``address``: ``@name`` (abstract) or a path; by default a fresh abstract name.
    """

    def __init__(self, max_queue: int = 1024, stale_s: float = 2.0, address: str = "") -> None:
        self.address = address or f"@fastft-bus-{os.getpid()}-{secrets.token_hex(8)}"
        self.max_queue = max_queue
        self.stale_s = stale_s
        self.stats = HubStats()
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}
        """Registered clients by file descriptor: the ones frames go to."""
        self._gone: list[_Client] = []
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_frame: Callable[[object, bytes], None] | None = None
        """Called (on the hub's thread: hand the work on) with a client's token and each
        frame it sends up; :meth:`send_to` answers that client."""

    def start(self) -> RelayHub:
        if self._thread is not None:
            return self
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lst.bind(sockaddr(self.address))
            lst.listen(512)
        except BaseException:
            lst.close()
            raise
        lst.setblocking(False)
        self._listener = lst
        self._sel.register(lst, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="fastft-bus-relay", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and disconnect every client. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._poke()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        with self._lock:
            for c in self._clients.values():
                c.sock.close()
            self._clients.clear()
        if self._listener is not None:
            self._listener.close()
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> RelayHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- frames (any thread) -----------------------------------------------------------------
    def fan_out(self, data: bytes) -> int:
        """Write ``data`` to every client (queued where its socket is full); returns how
        many clients it went to. Never blocks on a client."""
        frame = HEADER.pack(len(data)) + data
        n = 0
        poke = False
        with self._lock:
            self.stats.frames += 1
            for c in list(self._clients.values()):
                went = self._send_locked(c, frame)
                n += went is not None
                poke |= went is False
        if poke:
            self._poke()
        return n

    def send_to(self, token: object, data: bytes) -> bool:
        """Write ``data`` to the one client ``token`` (from :attr:`on_frame`), queued if
        its socket is full; False if it is gone."""
        with self._lock:
            c = token if isinstance(token, _Client) else None
            if c is None or self._clients.get(c.sock.fileno()) is not c:
                return False
            went = self._send_locked(c, HEADER.pack(len(data)) + data)
        if went is False:
            self._poke()
        return went is not None

    def _send_locked(self, c: _Client, frame: bytes) -> bool | None:
        """Under the lock: ``frame`` to ``c``, at once (True) or queued behind what its
        socket would not take (False); None: ``c`` is gone or cut off (dropped)."""
        if c.backlog:
            if len(c.backlog) >= HARD_CAP * self.max_queue:
                self._drop(c, f"{len(c.backlog)} frames queued")
                return None
            c.backlog.append(memoryview(frame))
            self.stats.queued += 1
            return False
        try:
            sent = c.sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(c, None)
            return None
        if sent == len(frame):
            return True
        c.progress_t = time.monotonic()  # (a queue starts: its reader's clock)
        c.backlog.append(memoryview(frame)[sent:])
        self.stats.queued += 1
        return False

    def _drop(self, c: _Client, why: str | None) -> None:
        """Under the lock: forget ``c``; the serving thread closes it. ``why``: it was cut
        off for not reading (None: it went away)."""
        if self._clients.pop(c.sock.fileno(), None) is None:
            return
        self.stats.clients = len(self._clients)
        self._gone.append(c)
        if why is not None:
            self.stats.cut_off += 1
            log.warning("bus relay: cut off %s, which stopped reading (%s)", c.label, why)
        self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    # --- the serving thread ------------------------------------------------------------------
    def _serve(self) -> None:
        pending: dict[int, _Client] = {}
        while not self._closed.is_set():
            self._update_masks()
            for key, events in self._sel.select(timeout=min(_TICK_S, self.stale_s / 2)):
                if key.data == "listen":
                    self._accept(pending)
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
                else:
                    c: _Client = key.data
                    if events & selectors.EVENT_READ:
                        self._on_readable(c, pending)
                    if events & selectors.EVENT_WRITE:
                        self._flush(c)
            self._expire(pending)
        for c in list(pending.values()):
            c.sock.close()

    def _update_masks(self) -> None:
        with self._lock:
            gone, self._gone = self._gone, []
            want = [(c, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.backlog else 0))
                    for c in self._clients.values()]  # fmt: skip
        for c in gone:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(c.sock)
            c.sock.close()
        for c, mask in want:
            if mask != c.mask:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.modify(c.sock, mask, c)
                c.mask = mask

    def _accept(self, pending: dict[int, _Client]) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("bus relay: accept failed: %s", e)
                return
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                self.stats.refused += 1
                log.error(
                    "bus relay: refused pid %d of user %d (only this job's user may connect)",
                    pid,
                    uid,
                )
                sock.close()
                continue
            sock.setblocking(False)
            c = _Client(sock)
            c.label = f"pid {pid}"
            pending[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _on_readable(self, c: _Client, pending: dict[int, _Client]) -> None:
        try:
            chunk = c.sock.recv(HELLO_MAX if c.sock.fileno() in pending else 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        fd = c.sock.fileno()
        if fd not in pending:  # a registered client: its end, or frames to the voice
            if not chunk or not self._frames_up(c, chunk):
                with self._lock:
                    self._drop(c, None)
            return
        c.hello += chunk
        if not chunk or (b"\n" not in c.hello and len(c.hello) >= HELLO_MAX):
            self._refuse(c, pending, "no label")
            return
        if b"\n" not in c.hello:
            return
        label = bytes(c.hello.split(b"\n", 1)[0]).decode(errors="replace")
        c.label = f"{label} ({c.label})"
        del pending[fd]
        with self._lock:  # registered and answered under the lock: no frame goes first
            try:
                c.sock.send(HEADER.pack(0))
            except OSError:
                self._gone.append(c)
                return
            self._clients[fd] = c
            self.stats.accepted += 1
            self.stats.clients = len(self._clients)

    def _frames_up(self, c: _Client, chunk: bytes) -> bool:
        """Hand each whole frame ``c`` sent up to :attr:`on_frame`; False if its stream is
        out of step (it is dropped, and connects again)."""
        c.up += chunk
        at = 0
        while len(c.up) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(c.up, at)
            if size == 0 or size > MAX_UP:
                log.warning("bus relay: %s sent a frame of %d bytes up: dropped", c.label, size)
                return False
            if len(c.up) - at - HEADER.size < size:
                break
            frame = bytes(c.up[at + HEADER.size : at + HEADER.size + size])
            at += HEADER.size + size
            if self.on_frame is not None:
                try:
                    self.on_frame(c, frame)
                except Exception:  # noqa: BLE001 - a bad frame must not end the relay
                    log.exception("bus relay: a frame from %s", c.label)
        del c.up[:at]
        return True

    def _refuse(self, c: _Client, pending: dict[int, _Client], why: str) -> None:
        pending.pop(c.sock.fileno(), None)
        self.stats.refused += 1
        log.warning("bus relay: refused %s (%s)", c.label, why)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(c.sock)
        c.sock.close()

    def _flush(self, c: _Client) -> None:
        with self._lock:
            while c.backlog:
                head = c.backlog[0]
                try:
                    sent = c.sock.send(head)
                except BlockingIOError:
                    return
                except OSError:
                    self._drop(c, None)
                    return
                c.progress_t = time.monotonic()
                if sent == len(head):
                    c.backlog.popleft()
                else:
                    c.backlog[0] = head[sent:]

    def _expire(self, pending: dict[int, _Client]) -> None:
        now = time.monotonic()
        for c in [c for c in pending.values() if now - c.since > HELLO_S]:
            self._refuse(c, pending, f"no label within {HELLO_S:.0f} s")
        with self._lock:
            for c in list(self._clients.values()):
                if len(c.backlog) >= self.max_queue and now - c.progress_t >= self.stale_s:
                    self._drop(c, f"{len(c.backlog)} frames queued, none read for "
                                  f"{now - c.progress_t:.1f} s")  # fmt: skip
