"""The NATS control plane: no single process or host is special.

``--control nats://h1:4222,nats://h2:4222,nats://h3:4222`` replaces the TCPStore that node
0's agent hosts with a NATS cluster (3 servers with JetStream survive the loss of any one):

* :class:`NatsStore` is a ``torch.distributed.Store`` over a JetStream key-value bucket
  (``fastft``, 3 replicas where the cluster has them, in memory): compare-and-set by
  revision for decisions, epochs and leases, counters by compare-and-set loops, and
  blocking reads that poll. Everything that used the TCPStore uses it unchanged, the
  process groups' rendezvous included (through a ``PrefixStore``), so no host is special.
* :class:`NatsTransport` carries the error bus on core NATS: one subject per job
  (``fastft.<job>.bus``), one publish per broadcast, which the servers fan out; FIFO per
  publisher. The servers cut off a subscriber that stops reading (slow consumer).

The client runs on one asyncio loop per process, in a daemon thread; every call here
blocks the calling thread until the loop answers or the store's timeout passes. The
client reconnects to another server of the list within ~50 ms of losing its own, and a
store call retries through that. Keys are escaped into the characters JetStream allows.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import logging
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch.distributed as dist

from fastft.bus.contract import BusConfig
from fastft.bus.endpoint import WAKE, BusEndpoint
from fastft.errors import StoreUnreachable

__all__ = [
    "BUCKET",
    "NatsStore",
    "NatsTransport",
    "connect_nats",
    "is_nats",
    "nats_bus",
    "shutdown",
]

log = logging.getLogger(__name__)

BUCKET = "fastft"
ATTEMPT_S = 0.25
"""How long one try of a store call waits for its answer (a store with a shorter timeout:
a third of it); then it is sent again."""
RECONNECT_WAIT_S = 0.05
"""How long the client waits before it tries the next server after losing one."""
_RETRY_S = (0.001, 0.05)
"""Retries of a store call that met a reconnection or a leader change: first and last pause."""
_RECHECK_S = 0.05
"""A blocking read of a missing key is woken by the key's write (every process watches the
bucket's subjects on core NATS); it reads again at least this often all the same."""

T = TypeVar("T")


def is_nats(address: str | None) -> bool:
    return bool(address) and str(address).startswith(("nats://", "tls://"))


# --- the loop -------------------------------------------------------------------------------
class _Loop:
    """One asyncio loop per process, in a daemon thread (started on first use)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name="fastft-nats", daemon=True)
                t.start()
                cls._loop = loop
            return cls._loop


def _run(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    fut = asyncio.run_coroutine_threadsafe(coro, _Loop.get())
    try:
        return fut.result(timeout_s)
    except TimeoutError:
        fut.cancel()
        raise


_CONNS: dict[str, _Conn] = {}
_CONNS_LOCK = threading.Lock()


class _Conn:
    """One client connection per server list and process, shared by every store clone and
    bus endpoint of the process."""

    def __init__(self, servers: list[str], timeout_s: float) -> None:
        import nats
        from nats.js.api import KeyValueConfig, StorageType
        from nats.js.errors import BucketNotFoundError

        self.servers = servers
        self.clones: list[NatsStore] = []
        self._waiters: dict[str, list[threading.Event]] = {}
        self._wlock = threading.Lock()
        self._watching = False

        async def connect() -> tuple[Any, Any, Any]:
            async def quiet(e: Exception) -> None:  # reconnects are logged, not raised
                log.debug("nats: %s", e)

            nc = await nats.connect(
                servers=servers,
                name="fastft",
                connect_timeout=max(1, int(min(timeout_s, 5))),
                reconnect_time_wait=RECONNECT_WAIT_S,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                error_cb=quiet,
            )
            js = nc.jetstream(timeout=min(timeout_s, 5.0))
            try:
                kv = await js.key_value(BUCKET)
            except BucketNotFoundError:
                kv = None
            if kv is None:
                for replicas in (3, 1):  # a single server cannot hold 3 replicas
                    try:
                        kv = await js.create_key_value(
                            KeyValueConfig(
                                bucket=BUCKET,
                                history=1,
                                storage=StorageType.MEMORY,
                                replicas=replicas,
                            )
                        )
                        break
                    except Exception as e:  # noqa: BLE001 - tried again with 1 replica
                        if replicas == 1:
                            raise
                        log.debug("nats: a %d-replica bucket: %s", replicas, e)
            return nc, js, kv

        try:
            self.nc, self.js, self.kv = _run(connect(), timeout_s + 5)
        except Exception as e:
            raise StoreUnreachable(_explain(servers, e)) from e

    def waiter(self, key: str) -> threading.Event:
        """An event set when ``key`` is next written (the first call subscribes to every
        write of the bucket: a JetStream write is also a core NATS message)."""
        ev = threading.Event()
        with self._wlock:
            self._waiters.setdefault(key, []).append(ev)
            start, self._watching = not self._watching, True
        if start:
            prefix = f"$KV.{BUCKET}."
            nc = self.nc

            async def on_write(msg: Any) -> None:
                with self._wlock:
                    evs = self._waiters.pop(msg.subject[len(prefix) :], [])
                for e in evs:
                    e.set()

            async def watch() -> None:
                await nc.subscribe(prefix + ">", cb=on_write, pending_msgs_limit=1 << 20)
                await nc.flush()

            _run(watch(), 5.0)
        return ev

    def forget(self, key: str, ev: threading.Event) -> None:
        with self._wlock:
            evs = self._waiters.get(key)
            if evs is not None and ev in evs:
                evs.remove(ev)
                if not evs:
                    del self._waiters[key]

    def close(self) -> None:
        try:
            _run(self.nc.close(), 2.0)
        except Exception:  # noqa: BLE001 - closing at exit
            pass


def _explain(servers: list[str], e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0][:200]
    where = ",".join(servers)
    if "jetstream" in text.lower() or "503" in text or "ServiceUnavailable" in text:
        return (
            f"the NATS servers at {where} have no JetStream ({text}): start them with "
            "JetStream on (nats-server -js, or fastft nats up)"
        )
    return f"no NATS server answers at {where} ({text}): check --control"


def connect_nats(address: str, timeout_s: float = 30.0, wait_s: float = 0.0) -> NatsStore:
    """A store on the NATS cluster at ``address`` (comma-separated URLs); raises
    StoreUnreachable with one line if no server answers (within ``wait_s``) or JetStream
    is off."""
    servers = [s.strip() for s in address.split(",") if s.strip()]
    if not servers or not all(is_nats(s) for s in servers):
        raise StoreUnreachable(f"--control {address!r}: use nats://HOST:PORT[,nats://HOST:PORT...]")
    key = ",".join(servers)
    with _CONNS_LOCK:
        conn = _CONNS.get(key)
        if conn is None:
            _reachable(servers, wait_s)
            conn = _CONNS[key] = _Conn(servers, timeout_s)
    return NatsStore(conn, timeout_s)


def _reachable(servers: list[str], wait_s: float) -> None:
    """Fail at once (after ``wait_s`` of retries) if no server of the list accepts a
    connection: the client itself would retry forever."""
    deadline = time.monotonic() + wait_s
    while True:
        errors = []
        for url in servers:
            host, _, port = url.split("://", 1)[1].rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port or 4222)), timeout=2.0):
                    return
            except (OSError, ValueError) as e:
                errors.append(f"{url}: {getattr(e, 'strerror', None) or e}")
        if time.monotonic() >= deadline:
            raise StoreUnreachable(
                f"no NATS server answers at {','.join(servers)} ({'; '.join(errors)[:300]}): "
                "check --control"
            )
        time.sleep(0.1)


@atexit.register
def shutdown() -> None:
    """Close this process's NATS connections and stop its loop (at exit, or in tests)."""
    with _CONNS_LOCK:
        conns = list(_CONNS.values())
        _CONNS.clear()
    for c in conns:
        c.close()
    with _Loop._lock:
        loop, _Loop._loop = _Loop._loop, None
    if loop is None:
        return

    async def cancel_rest() -> None:
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(2.0)
    except Exception:  # noqa: BLE001 - stopping anyway
        pass
    loop.call_soon_threadsafe(loop.stop)


# --- the store ------------------------------------------------------------------------------
_KEY_OK = re.compile(r"[A-Za-z0-9_/-]")


def _key(key: str) -> str:
    """A store key in the characters a JetStream key may hold (``=XX`` escapes)."""
    out = "".join(
        c if _KEY_OK.fullmatch(c) else "".join(f"={b:02X}" for b in c.encode()) for c in key
    )
    return out or "=00"


def _b(value: bytes | str | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class NatsStore(dist.Store):
    """``torch.distributed.Store`` over the job's JetStream key-value bucket."""

    def __init__(self, conn: _Conn, timeout_s: float = 30.0) -> None:
        super().__init__()
        self._conn = conn
        self.address = ",".join(conn.servers)
        self.timeout_s = timeout_s
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()
        super().set_timeout(timeout)

    def clone(self) -> NatsStore:
        """A store object of its own (its own timeout) on the same connection. Kept
        referenced for the process's life: torch may hold it from C++ alone, and a Python
        store whose Python object is gone fails ("Not implemented")."""
        c = NatsStore(self._conn, self.timeout_s)
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
                return _run(asyncio.wait_for(make(), min(attempt, max(0.01, left))), left + 1)
            except (
                TimeoutError,
                NoRespondersError,
                ServiceUnavailableError,
                NoStreamResponseError,
                ConnectionClosedError,
                asyncio.TimeoutError,
            ) as e:
                if time.monotonic() + pause >= deadline:
                    raise dist.DistStoreError(
                        f"NATS store: no answer within {limit:.1f} s ({type(e).__name__})"
                    ) from e
            time.sleep(pause)
            pause = min(pause * 2, _RETRY_S[1])

    def _write(self, key: str, value: bytes, last: int | None) -> int:
        """Put ``value`` (``last``: only if the key's revision is that, 0 for a new key);
        raises KeyWrongLastSequenceError when it is not. Idempotent under retries."""
        from nats.js.errors import APIError, KeyWrongLastSequenceError

        js = self._conn.js
        headers = {"Nats-Msg-Id": uuid.uuid4().hex}
        if last is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(last)
        subject = f"$KV.{BUCKET}.{key}"

        async def publish() -> int:
            try:
                ack = await js.publish(subject, value, headers=headers)
            except APIError as e:
                if e.err_code in (10071, 10164):  # wrong last sequence
                    raise KeyWrongLastSequenceError(description=e.description) from e
                raise
            return int(ack.seq)

        return int(self._call(publish))

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
                e = await kv._get(key)  # (the public get hides a tombstone's revision)
                return e, int(e.revision)
            except KeyDeletedError as err:
                return None, int(err.entry.revision) if err.entry is not None else 0
            except KeyNotFoundError:
                return None, 0

        return self._call(get)

    # --- dist.Store ------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._write(_key(key), _b(value), None)

    def get(self, key: str) -> bytes:
        """The value; waits for a missing key until the store's timeout."""
        k = _key(key)
        deadline = time.monotonic() + self.timeout_s
        while True:
            e = self._entry(k)
            if e is not None:
                return bytes(e.value or b"")
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"NATS store: timeout waiting for key {key!r}")
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

        k = _key(key)
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

        k, want, new = _key(key), _b(expected_value), _b(desired_value)
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
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def check(self, keys: list[str]) -> bool:
        return all(self._entry(_key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        saved = self.timeout_s
        if timeout is not None:
            self.set_timeout(timeout)
        try:
            for k in keys:
                self.get(k)
        finally:
            self.set_timeout(datetime.timedelta(seconds=saved))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True (without a read first: a delete of a missing key only
        leaves a tombstone, and nothing here needs to know)."""
        kv = self._conn.kv
        k = _key(key)
        self._call(lambda: kv.delete(k, validate_keys=False))
        return True

    # the names torch's C++ side calls
    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return self.delete_key(key)

    def getNumKeys(self) -> int:  # noqa: N802
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


# --- the bus --------------------------------------------------------------------------------
_FROM = "Fastft-From"
"""Header naming the publishing endpoint, so that it skips its own messages."""


class NatsTransport:
    """The error bus on core NATS: one subject per job, fanned out by the servers."""

    def __init__(self, store: NatsStore, config: BusConfig) -> None:
        self.config = config
        self._conn = store._conn
        self.subject = f"fastft.{_key(config.job).replace('/', '_')}.bus"
        self._queue: queue.SimpleQueue[bytes] | None = None
        self._sub: Any = None
        self.id: str | None = None
        self.evictions = 0
        self._timeout_s = store.timeout_s

    def join(self, label: str) -> str:
        nc = self._conn.nc
        me = self.id = f"{label}@{id(self):x}"
        q: queue.SimpleQueue[bytes] = queue.SimpleQueue()

        async def on_msg(msg: Any) -> None:
            if msg.headers and msg.headers.get(_FROM) == me:
                return  # the servers echo a publisher's own messages
            q.put_nowait(msg.data)  # the listener thread blocks on q itself

        async def subscribe() -> Any:
            sub = await nc.subscribe(self.subject, cb=on_msg, pending_msgs_limit=1 << 20)
            await nc.flush()
            return sub

        self._queue = q
        self._sub = _run(subscribe(), self._timeout_s)
        return me

    def leave(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                _run(sub.unsubscribe(), 2.0)
            except Exception:  # noqa: BLE001 - the connection may be gone
                log.debug("nats: unsubscribe failed", exc_info=True)

    def is_member(self) -> bool:
        return self._sub is not None

    def push_all(self, data: bytes) -> int:
        nc = self._conn.nc

        headers = {_FROM: self.id} if self.id else None

        async def publish() -> None:
            await nc.publish(self.subject, data, headers=headers)

        _run(publish(), self._timeout_s)
        return 1

    def pop(self) -> bytes | None:
        q = self._queue
        assert q is not None
        try:
            return q.get(timeout=self.config.idle_pop_s)
        except queue.Empty:
            return None

    def wake(self) -> None:
        q = self._queue
        if q is not None:
            q.put_nowait(WAKE)

    def close(self) -> None:
        self.leave()


def nats_bus(store: NatsStore, config: BusConfig) -> BusEndpoint:
    """An endpoint on the NATS control plane (not started)."""
    return BusEndpoint(config, NatsTransport(store, config))
