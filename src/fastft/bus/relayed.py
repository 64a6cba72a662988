"""A worker's end of its node's bus relay (:mod:`fastft.bus.relay`).

The worker publishes through the backend as before (one push per subscriber, and the
subscribers are now the agents and the operator's tools: one per node, not one per
worker) and receives from its agent's hub. The hub sends it its own frames too (they
reached its agent like anyone's); it drops those by their bytes, which are unique (a
sequence number and a wall time in every one, and the sender's nonce when sealed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import Callable

from fastft.bus.contract import Transport
from fastft.bus.endpoint import WAKE
from fastft.bus.relay import HEADER, HELLO_MAX, HELLO_S, VOICE, sockaddr
from fastft.errors import RelayUnreachable

__all__ = ["MAX_FRAME", "RelayedTransport"]

log = logging.getLogger(__name__)

MAX_FRAME = 16 << 20
"""A longer length on the relay's stream means it is out of step: the connection is
dropped and made again."""
UP_S = 0.5
"""How long a frame up to the agent may wait for the socket to take it."""
_ECHOES = 4096
"""Own frames remembered until their echo from the hub comes back (oldest forgotten)."""


class RelayedTransport:
    """Publishes with ``publisher`` (the backend's transport, never joined), receives from
    the relay hub at ``address``. ``idle_pop_s``: how long a pop waits before it returns
    None (the endpoint then checks that it is still connected)."""

    def __init__(self, publisher: Transport, address: str, idle_pop_s: float) -> None:
        self._pub = publisher
        self.address = address
        self._idle_pop_s = idle_pop_s
        self._sock: socket.socket | None = None
        self._poll: select.poll | None = None
        self._buf = bytearray()
        self._frames: deque[bytes] = deque()
        self._sent: OrderedDict[bytes, None] = OrderedDict()
        self._sent_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.id: str | None = None
        self.on_voice: Callable[[bytes], None] | None = None
        """Called (on the popping thread) with each frame from the node's voice, its
        :data:`~fastft.bus.relay.VOICE` prefix removed (:mod:`fastft.bus.relayvoice`)."""
        self._up_lock = threading.Lock()
        self.lost = 0
        """Connections to the hub that ended under this transport (cut off, or broken)."""

    @property
    def evictions(self) -> int:
        return self._pub.evictions

    def join(self, label: str) -> str:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(HELLO_S)
            sock.connect(sockaddr(self.address))
            sock.sendall(label.encode()[: HELLO_MAX - 1] + b"\n")
            answer = b""
            while len(answer) < HEADER.size:
                chunk = sock.recv(HEADER.size - len(answer))
                if not chunk:
                    break
                answer += chunk
        except OSError as e:
            sock.close()
            raise RelayUnreachable(
                f"the node's bus relay at {self.address} did not answer ({e}): is this "
                "process's agent running?"
            ) from e
        if answer != HEADER.pack(0):
            sock.close()
            raise RelayUnreachable(f"the node's bus relay at {self.address} refused this process")
        sock.setblocking(False)
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        poll.register(self._wake_r, select.POLLIN)
        self._buf.clear()
        self._frames.clear()
        self._sock, self._poll = sock, poll
        self.id = f"relay:{label}"
        return self.id

    def leave(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def is_member(self) -> bool:
        return self._sock is not None

    def push_all(self, data: bytes) -> int:
        with self._sent_lock:  # before the push: the echo may come back before it returns
            self._sent[data] = None
            if len(self._sent) > _ECHOES:
                self._sent.popitem(last=False)
        return self._pub.push_all(data)

    def pop(self) -> bytes | None:
        if self._frames:
            return self._frames.popleft()
        sock, poll = self._sock, self._poll
        if sock is None or poll is None:  # (between a lost connection and the next join)
            return WAKE if self._wait_wake() else None
        ms = int(self._idle_pop_s * 1000)
        while True:
            ready = {fd for fd, _ in poll.poll(ms)}
            if self._wake_r in ready:
                self._drain_wake()
                return WAKE
            if not ready:
                return None
            try:
                chunk = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if not chunk or not self._parse(chunk):
                self._lose(sock)
                return None
            if self._frames:
                return self._frames.popleft()

    def _parse(self, chunk: bytes) -> bool:
        """Append the whole frames in ``chunk`` (after what was buffered) to the queue,
        but this process's own; False if the stream is out of step."""
        buf = self._buf
        buf += chunk
        at = 0
        while len(buf) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, at)
            if size > MAX_FRAME or size == 0:
                return False
            if len(buf) - at - HEADER.size < size:
                break
            frame = bytes(buf[at + HEADER.size : at + HEADER.size + size])
            at += HEADER.size + size
            if frame.startswith(VOICE):
                if self.on_voice is not None:
                    self.on_voice(frame[len(VOICE) :])
                continue
            with self._sent_lock:
                own = self._sent.pop(frame, False) is None
            if not own:
                self._frames.append(frame)
        del buf[:at]
        return True

    def send_up(self, data: bytes, timeout_s: float = UP_S) -> bool:
        """Send ``data`` up to the node's agent (a request to its voice); False if there
        is no connection or it would not take the frame within ``timeout_s``."""
        frame = memoryview(HEADER.pack(len(data)) + data)
        with self._up_lock:
            sock = self._sock
            if sock is None:
                return False
            poll = select.poll()
            poll.register(sock, select.POLLOUT)
            whole = len(frame)
            while frame:
                try:
                    frame = frame[sock.send(frame) :]
                    continue
                except (BlockingIOError, InterruptedError):
                    if poll.poll(int(timeout_s * 1000)):
                        continue
                except OSError:
                    pass
                if len(frame) < whole:  # (half a frame: the stream is out of step; the
                    with contextlib.suppress(OSError):  # popping thread connects again)
                        sock.shutdown(socket.SHUT_RDWR)
                return False
        return True

    def _lose(self, sock: socket.socket) -> None:
        self.lost += 1
        if self._sock is sock:
            self._sock = None
        sock.close()

    def _wait_wake(self) -> bool:
        poll = select.poll()  # (not select(): a process may hold descriptors past 1,024)
        poll.register(self._wake_r, select.POLLIN)
        ready = poll.poll(int(min(self._idle_pop_s, 1.0) * 1000))
        if ready:
            self._drain_wake()
        return bool(ready)

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._wake_r, 4096)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        self.leave()
        self._pub.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
