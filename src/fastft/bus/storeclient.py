"""A TCPStore client in pure Python, for the operator's commands (``fastft inject``,
``report-error``, ``drain``, ``bus tail``): they start in ~0.1 s instead of the ~1.5 s an
``import torch`` costs, and open no connection through torch's reverse DNS lookup.

It speaks the subset of torch's TCPStore protocol that the error bus uses, as torch 2.13
(the pinned version) speaks it; ``tests/unit/test_storeclient.py`` checks every operation
against torch's own server and client, so a protocol change in torch fails there first.

Wire format (little endian): one byte of query type, then its arguments; a string or a
value is a ``u64`` length and its bytes. Keys carry the prefix ``/`` that torch's client
adds. A connection opens with ``VALIDATE`` (the magic number, no answer) and ``PING`` (a
nonce, echoed). ``GET`` and a blocking ``QUEUE_POP`` first ``WAIT`` for the key, and a wait
that times out is cancelled (``CANCEL_WAIT``) so that the connection stays usable.

The workers and agents keep torch's client: the process groups' rendezvous needs a
``torch.distributed.Store``.
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
import threading
from collections.abc import Sequence

from fastft.errors import StoreTimeout, StoreUnreachable

__all__ = ["StoreClient", "QueueEmpty"]

MAGIC = 0x3C85F7CE
_PREFIX = "/"

_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = range(7)
_CANCEL_WAIT, _PING, _QUEUE_PUSH, _QUEUE_POP, _QUEUE_LEN = 12, 13, 14, 15, 16
_READY = 0  # CHECK's answer when every key exists
_STOP_WAITING, _WAIT_CANCELED = 0, 1

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")


class QueueEmpty(Exception):
    """A non-blocking pop found the queue empty."""


def _blob(data: bytes | str) -> bytes:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return _U64.pack(len(raw)) + raw


def _key(key: str) -> bytes:
    return _blob(_PREFIX + key)


class StoreClient:
    """One connection to a TCPStore server; thread-safe (one operation at a time)."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=min(timeout_s, 5.0))
        except OSError as e:
            raise StoreUnreachable(f"no store answers at {host}:{port} ({e.strerror or e})") from e
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.getpid() & 0xFFFFFFFF
        try:
            self._sock.sendall(
                bytes([_VALIDATE]) + _U32.pack(MAGIC) + bytes([_PING]) + _U32.pack(nonce)
            )
            echoed = _U32.unpack(self._recv(4, min(timeout_s, 5.0)))[0]
        except (OSError, StoreTimeout) as e:
            self._sock.close()
            raise StoreUnreachable(
                f"{host}:{port} accepts connections but does not answer as a store: is it the "
                "job's store (--store)?"
            ) from e
        if echoed != nonce:
            self._sock.close()
            raise StoreUnreachable(
                f"{host}:{port} does not answer as a store (a wrong handshake): is it the "
                "job's store (--store)?"
            )

    # --- torch.distributed.Store's names -----------------------------------------------------
    def clone(self) -> StoreClient:
        return StoreClient(self.host, self.port, self.timeout_s)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._send(_SET, _key(key) + _blob(value))

    def get(self, key: str) -> bytes:
        """The value; waits for a missing key until the timeout (StoreTimeout)."""
        with self._lock:
            self._wait(key)
            self._sock.sendall(bytes([_GET]) + _key(key))
            return self._recv_blob()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._sock.sendall(bytes([_ADD]) + _key(key) + _I64.pack(amount))
            return int(_I64.unpack(self._recv(8))[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        with self._lock:
            self._sock.sendall(bytes([_COMPARE_SET]) + _key(key) + _blob(expected) + _blob(desired))
            return self._recv_blob()

    def check(self, keys: Sequence[str]) -> bool:
        with self._lock:
            self._sock.sendall(
                bytes([_CHECK]) + _U64.pack(len(keys)) + b"".join(_key(k) for k in keys)
            )
            return self._recv(1)[0] == _READY

    def queue_push(self, key: str, value: bytes | str) -> None:
        self._send(_QUEUE_PUSH, _key(key) + _blob(value))

    def queue_len(self, key: str) -> int:
        with self._lock:
            self._sock.sendall(bytes([_QUEUE_LEN]) + _key(key))
            return int(_I64.unpack(self._recv(8))[0])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The queue's head; ``block``: wait for one until the timeout (StoreTimeout),
        else raise QueueEmpty at once."""
        with self._lock:
            while True:
                if block:
                    self._wait(key)
                self._sock.sendall(bytes([_QUEUE_POP]) + _key(key))
                if _U64.unpack(self._recv(8))[0]:
                    return self._recv_blob()
                if not block:
                    raise QueueEmpty(f"queue {key!r} is empty")
                # another reader took it between the wait and the pop: wait again

    def close(self) -> None:
        self._sock.close()

    # --- plumbing ------------------------------------------------------------------------
    def _send(self, query: int, body: bytes) -> None:
        with self._lock:
            self._sock.sendall(bytes([query]) + body)

    def _wait(self, key: str) -> None:
        """Until ``key`` exists (a queue: is not empty), at most the timeout; a wait that
        times out is cancelled, and the server's answers to it read, before raising."""
        self._sock.sendall(bytes([_WAIT]) + _U64.pack(1) + _key(key))
        try:
            answer = self._recv(1, self.timeout_s)[0]
        except StoreTimeout:
            self._sock.sendall(bytes([_CANCEL_WAIT]))
            answer = self._recv(1)[0]
            if answer == _STOP_WAITING:  # it came as we cancelled
                answer = self._recv(1)[0]
            if answer != _WAIT_CANCELED:
                msg = f"store {self.host}:{self.port}: bad answer to a cancel"
                raise StoreUnreachable(msg) from None
            raise StoreTimeout(f"wait timeout after {self.timeout_s:.1f} s, key {key!r}") from None
        if answer != _STOP_WAITING:
            raise StoreUnreachable(f"store {self.host}:{self.port}: bad answer to a wait")

    def _recv(self, n: int, timeout_s: float | None = None) -> bytes:
        self._sock.settimeout(timeout_s if timeout_s is not None else max(self.timeout_s, 5.0))
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self._sock.recv(n - len(buf))
            except TimeoutError as e:
                if buf:  # half an answer: the stream is out of step, not slow
                    raise StoreUnreachable(
                        f"store {self.host}:{self.port} stopped mid-answer"
                    ) from e
                raise StoreTimeout(f"store {self.host}:{self.port}: no answer") from e
            if not chunk:
                raise StoreUnreachable(f"store {self.host}:{self.port} closed the connection")
            buf += chunk
        return bytes(buf)

    def _recv_blob(self) -> bytes:
        return self._recv(_U64.unpack(self._recv(8))[0])
