"""The NATS control plane: no single process or host is special.

``--control nats://h1:4222,nats://h2:4222,nats://h3:4222`` replaces the TCPStore that node
0's agent hosts with a NATS cluster (3 servers with JetStream survive the loss of any one):

* :class:`NatsKV` is a store over a JetStream key-value bucket
  (``fastft``, 3 replicas where the cluster has them, in memory): compare-and-set by
  revision for decisions, epochs and leases, counters by compare-and-set loops, and
  blocking reads that poll. :class:`~fastft.bus.natsstore.NatsStore` makes it a
  ``torch.distributed.Store``: everything that used the TCPStore uses it unchanged, the
  process groups' rendezvous included (through a ``PrefixStore``), so no host is special.
  The operator's commands use ``NatsKV`` alone, without importing torch.
* :class:`~fastft.bus.natsbus.NatsTransport` carries the error bus on core NATS: one subject per job
  (``fastft.<job>.bus``), one publish per broadcast, which the servers fan out; FIFO per
  publisher. The servers cut off a subscriber that stops reading (slow consumer).

The client runs on one asyncio loop per process, in a daemon thread; every call here
blocks the calling thread until the loop answers or the store's timeout passes. The
client reconnects to another server of the list within ~50 ms of losing its own (one cut
off: after a try and a ping unanswered, ``natsio.Conn.suspect``); store calls retry. Keys are escaped into the characters JetStream allows.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastft.bus.natsio import BUCKET, Conn, connection, run, shutdown
from fastft.errors import StoreTimeout, StoreUnreachable

if TYPE_CHECKING:
    from fastft.bus.natswatch import NatsWatch

__all__ = [
    "BUCKET",
    "NatsKV",
    "connect_kv",
    "escape_by_character",
    "escape_key",
    "nats_connection",
    "is_nats",
    "shutdown",
]

log = logging.getLogger(__name__)

ATTEMPT_S = 0.25
"""How long one try of a store call waits for its answer (a store with a shorter timeout:
a third of it); then it is sent again."""
_RETRY_S = (0.001, 0.05)
"""Retries of a store call that met a reconnection or a leader change: first and last pause."""
_RECHECK_S = 0.05
"""A blocking read of a missing key is woken by the key's write (every process watches the
bucket's subjects on core NATS); it reads again at least this often all the same."""


class _InProcess(Exception):
    """JetStream still processes an earlier try of this write (same message id): retry."""


def is_nats(address: str | None) -> bool:
    return bool(address) and str(address).startswith(("nats://", "tls://"))


def nats_connection(address: str, timeout_s: float = 30.0, wait_s: float = 0.0) -> Conn:
    """A connection to the NATS cluster at ``address`` (comma-separated URLs). Raises
    StoreUnreachable with one line if no server answers (within ``wait_s``) or JetStream is
    off."""
    servers = [s.strip() for s in address.split(",") if s.strip()]
    if not servers or not all(is_nats(s) for s in servers):
        raise StoreUnreachable(f"--control {address!r}: use nats://HOST:PORT[,nats://HOST:PORT...]")
    return connection(servers, timeout_s, wait_s)


def connect_kv(address: str, timeout_s: float = 30.0, wait_s: float = 0.0) -> NatsKV:
    """The job's store on the NATS cluster at ``address`` without torch (the operator's
    commands); :func:`fastft.bus.natsstore.connect_nats` for a ``torch.distributed.Store``."""
    return NatsKV(nats_connection(address, timeout_s, wait_s), timeout_s)


# --- the store ------------------------------------------------------------------------------
_KEY_OK = re.compile(r"[A-Za-z0-9_/-]")


async def _publish(js: Any, subject: str, value: bytes, headers: dict[str, str]) -> int:
    """One write to the bucket: its stream sequence. A wrong last sequence raises
    KeyWrongLastSequenceError; a retry still in process, ``_InProcess`` (retried)."""
    from nats.js.errors import APIError, KeyWrongLastSequenceError

    try:
        ack = await js.publish(subject, value, headers=headers)
    except APIError as e:
        if e.err_code in (10071, 10164):  # wrong last sequence
            raise KeyWrongLastSequenceError(description=e.description) from e
        if e.err_code == 10158:  # duplicate message id is in process
            raise _InProcess(e.description) from e
        raise
    return int(ack.seq)


_PLAIN = re.compile(r"[A-Za-z0-9_-]+(?:/[A-Za-z0-9_-]+)*")
"""A key whose every path part is plain characters: its escape is its ``/`` made ``.``."""


def escape_key(key: str) -> str:
    """A store key in the characters a JetStream key may hold (``=XX`` escapes), each part
    of its path a token of the subject (``/`` as ``.``, but where it would leave a token
    empty), so that the keys under a prefix can be watched
    (:mod:`fastft.bus.natswatch`)."""
    if _PLAIN.fullmatch(key):  # (the job's keys, but for a leading /: one C-level check,
        return key.replace("/", ".")  # where a check per character cost ~6 us a key)
    return escape_by_character(key)


def escape_by_character(key: str) -> str:
    """:func:`escape_key` one character at a time (any key; its fast path is tested
    against this)."""
    out = []
    for i, c in enumerate(key):
        if c == "/" and 0 < i < len(key) - 1 and key[i - 1] != "/":
            out.append(".")
        elif _KEY_OK.fullmatch(c) and c != "/":
            out.append(c)
        else:
            out.append("".join(f"={b:02X}" for b in c.encode()))
    return "".join(out) or "=00"


def _b(value: bytes | str | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class NatsKV:
    """The job's store over its JetStream key-value bucket, with ``torch.distributed.Store``'s
    methods (and no torch: :class:`~fastft.bus.natsstore.NatsStore` adds the base class)."""

    _Timeout: type[Exception] = StoreTimeout
    """What a call that runs out of time raises (NatsStore: torch's ``DistStoreError``)."""

    def __init__(self, conn: Conn, timeout_s: float = 30.0) -> None:
        super().__init__()
        self._conn = conn
        self.address = ",".join(conn.servers)
        self.timeout_s = timeout_s
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    @property
    def conn(self) -> Conn:
        """The cluster connection (the bus on the same cluster shares it)."""
        return self._conn

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()
        parent = getattr(super(), "set_timeout", None)  # torch's Store keeps its own
        if parent is not None:
            parent(timeout)

    def clone(self) -> NatsKV:
        """A store object of its own (its own timeout) on the same connection. Kept
        referenced for the process's life: torch may hold it from C++ alone, and a Python
        store whose Python object is gone fails ("Not implemented")."""
        c = type(self)(self._conn, self.timeout_s)
        self._conn.clones.append(c)
        return c

    # --- plumbing ------------------------------------------------------------------------
    def _call(self, make: Any, timeout_s: float | None = None) -> Any:
        """Run ``make()``'s coroutine on the loop, each try bounded by ``ATTEMPT_S`` (a
        request whose server died is not answered); retry through reconnections and
        leader elections until the timeout. Writes carry a message id, so that a retry of
        one that landed is not applied twice (JetStream drops the duplicate)."""
        from nats.errors import ConnectionClosedError, NoRespondersError, TimeoutError
        from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

        limit = self.timeout_s if timeout_s is None else timeout_s
        attempt = min(ATTEMPT_S, max(limit / 3, 0.02))
        deadline = time.monotonic() + limit
        pause = _RETRY_S[0]
        while True:
            left = deadline - time.monotonic()
            try:
                return run(asyncio.wait_for(make(), min(attempt, max(0.01, left))), left + 1)
            except (
                TimeoutError,
                NoRespondersError,
                ServiceUnavailableError,
                NoStreamResponseError,
                ConnectionClosedError,
                asyncio.TimeoutError,
                _InProcess,
            ) as e:
                if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                    self._conn.suspect()  # (a server cut off answers nothing, ever)
                if time.monotonic() + pause >= deadline:
                    raise self._Timeout(
                        f"NATS store: no answer within {limit:.1f} s ({type(e).__name__})"
                    ) from e
            time.sleep(pause)
            pause = min(pause * 2, _RETRY_S[1])

    def _write(self, key: str, value: bytes, last: int | None) -> int:
        """Put ``value`` (``last``: only if the key's revision is that, 0 for a new key);
        raises KeyWrongLastSequenceError when it is not. Idempotent under retries."""
        js = self._conn.js
        headers = {"Nats-Msg-Id": uuid.uuid4().hex}
        if last is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(last)
        subject = f"$KV.{BUCKET}.{key}"
        return int(self._call(lambda: _publish(js, subject, value, headers)))

    def _entry(self, key: str) -> Any:
        """The key's entry, or None if it does not exist."""
        return self._read(key)[0]

    def _read(self, key: str) -> tuple[Any, int]:
        """(the key's entry or None, the revision a write must expect: the entry's, a
        deleted key's tombstone's, 0 for a key never written)."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        kv = self._conn.kv

        async def get() -> tuple[Any, int]:
            try:
                e = await kv._get(key)  # noqa: SLF001 - nats-py's public get hides a tombstone's revision
                return e, int(e.revision)
            except KeyDeletedError as err:
                return None, int(err.entry.revision) if err.entry is not None else 0
            except KeyNotFoundError:
                return None, 0

        return self._call(get)

    # --- torch.distributed.Store's ------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._write(escape_key(key), _b(value), None)

    def get(self, key: str) -> bytes:
        """The value; waits for a missing key until the store's timeout."""
        k = escape_key(key)
        deadline = time.monotonic() + self.timeout_s
        while True:
            e = self._entry(k)
            if e is not None:
                return bytes(e.value or b"")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._Timeout(f"NATS store: timeout waiting for key {key!r}")
            ev = self._conn.waiter(k)
            try:
                e = self._entry(k)  # written before the waiter was in place?
                if e is not None:
                    return bytes(e.value or b"")
                ev.wait(min(left, _RECHECK_S))
            finally:
                self._conn.forget(k, ev)

    def add(self, key: str, amount: int) -> int:
        from nats.js.errors import KeyWrongLastSequenceError

        k = escape_key(key)
        while True:
            e, rev = self._read(k)
            cur = int(e.value or b"0") if e is not None else 0
            new = str(cur + amount).encode()
            try:
                self._write(k, new, rev)
                return cur + amount
            except KeyWrongLastSequenceError:
                continue  # another writer came first: read again

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        """TCPStore's semantics: set ``desired`` if the value is ``expected`` (a missing
        key counts as an empty one); return the value that holds."""
        from nats.js.errors import KeyWrongLastSequenceError

        k, want, new = escape_key(key), _b(expected_value), _b(desired_value)
        if not want:  # most often a new key (a decision): try creating it at once
            try:
                self._write(k, new, 0)
                return new
            except KeyWrongLastSequenceError:
                pass  # it exists (or existed): read and compare
        while True:
            e, rev = self._read(k)
            if e is None and want:
                return want
            cur = bytes(e.value or b"") if e is not None else b""
            if e is not None and cur != want:
                return cur
            try:
                self._write(k, new, rev)
                return new
            except KeyWrongLastSequenceError:
                continue

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every value, read concurrently (one round trip, not one per key); a key still
        missing is then waited for as ``get`` does."""
        from nats.js.errors import KeyNotFoundError

        kv = self._conn.kv
        ks = [escape_key(k) for k in keys]

        async def read_all() -> list[Any]:
            async def one(k: str) -> Any:
                try:
                    return await kv.get(k, validate_keys=False)
                except KeyNotFoundError:
                    return None

            return list(await asyncio.gather(*(one(k) for k in ks)))

        got = self._call(read_all)
        return [
            bytes(e.value or b"") if e is not None else self.get(k)
            for e, k in zip(got, keys, strict=True)
        ]

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """Every value or None, read concurrently (one round trip, no wait for a missing
        key): what a formation reads here instead of counting arrivals with ``add``, which
        is a compare-and-set loop on NATS (N concurrent adds: O(N^2) attempts)."""
        from nats.js.errors import KeyNotFoundError

        kv = self._conn.kv

        async def read_all() -> list[Any]:
            async def one(k: str) -> Any:
                try:
                    return await kv.get(escape_key(k), validate_keys=False)
                except KeyNotFoundError:
                    return None

            return list(await asyncio.gather(*(one(k) for k in keys)))

        return [bytes(e.value or b"") if e is not None else None for e in self._call(read_all)]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Put every value, concurrently (one round trip: a node's voice writes its
        workers' arrivals so); each put carries its message id across retries."""
        js = self._conn.js
        puts = [
            (f"$KV.{BUCKET}.{escape_key(k)}", _b(v), {"Nats-Msg-Id": uuid.uuid4().hex})
            for k, v in zip(keys, values, strict=True)
        ]

        async def put_all() -> None:  # (each as a write: a retry in process is retried)
            await asyncio.gather(*(_publish(js, s, v, h) for s, v, h in puts))

        self._call(put_all)

    def watch(self, prefix: str) -> NatsWatch:
        """Every value under ``prefix`` (a path ending in ``/``), now and as written: the
        servers push them (:mod:`fastft.bus.natswatch`)."""
        from fastft.bus.natswatch import NatsWatch

        subject = escape_key(prefix.rstrip("/")) + ".>"
        return NatsWatch(self._conn, prefix, subject, self.timeout_s)

    def read_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every value under ``prefix`` now (a watch's first values, pushed)."""
        w = self.watch(prefix)
        try:
            if not w.ready.wait(self.timeout_s):
                raise self._Timeout(f"NATS store: no answer to a watch of {prefix!r}")
            return w.values()
        finally:
            w.close()

    def check(self, keys: list[str]) -> bool:
        return all(self._entry(escape_key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        saved = self.timeout_s
        if timeout is not None:
            self.set_timeout(timeout)
        try:
            for k in keys:
                self.get(k)
        finally:
            self.set_timeout(datetime.timedelta(seconds=saved))

    def deleteescape_key(self, key: str) -> bool:
        """Remove ``key`` and every trace of it (a purge of its subject: a KV delete would
        leave a tombstone per key, and a long job deletes two keys per step); True, with
        no read first (nothing here needs to know whether it existed)."""
        js = self._conn.js
        subject = f"$KV.{BUCKET}.{escape_key(key)}"
        self._call(lambda: js.purge_stream(f"KV_{BUCKET}", subject=subject))
        return True

    # the names torch's C++ side calls
    def deleteKey(self, key: str) -> bool:
        return self.deleteescape_key(key)

    def getNumKeys(self) -> int:
        return self.num_keys()

    def num_keys(self) -> int:
        from nats.js.errors import NoKeysError

        kv = self._conn.kv

        async def count() -> int:
            try:
                return len(await kv.keys())
            except NoKeysError:
                return 0

        return int(self._call(count))
