"""The NATS client of one process: one asyncio loop in a daemon thread, and one
connection per server list, shared by every store object and bus endpoint of the process
(:mod:`fastft.bus.nats`). The client reconnects to another server of the list within
~50 ms of losing its own. A server cut off sends no reset: a call that gets no answer in
time pings it (:meth:`Conn.suspect`), and one that does not answer the ping either is left
for another server of the list; an idle connection finds it out by the client's own pings
(``PING_S``). ``shutdown()`` (at exit, or in tests) closes them."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastft.bus.natsconnect import (
    RECONNECT_WAIT_S,
    client_options,
    explain,
    reachable,
    with_retries,
)
from fastft.errors import StoreUnreachable

__all__ = ["BUCKET", "Conn", "connection", "pinned", "run", "shutdown"]

log = logging.getLogger(__name__)

BUCKET = "fastft"
"""The JetStream key-value bucket of the control plane."""
PROBE_S = 0.2
"""A call that got no answer in time pings the server: no answer within this long either,
and the client leaves it for another server (:meth:`Conn.suspect`)..."""
REPROBE_S = 1.0
"""...at most once this often per connection (a slow JetStream leader answers pings: a
stream of timeouts from it leads to one ping per second, not one per call)."""
SHUN_S = 10.0
"""A server left for not answering is not tried again for this long while another is there
(nats-py alone shuffles the list: the server cut off came first again in 1 of 3 tries, and
its connect timed out after 5 s)."""

T = TypeVar("T")


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

    @classmethod
    def take(cls) -> asyncio.AbstractEventLoop | None:
        """The loop, if one was started, which the caller now stops (shutdown)."""
        with cls._lock:
            loop, cls._loop = cls._loop, None
        return loop


def run(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    fut = asyncio.run_coroutine_threadsafe(coro, _Loop.get())
    try:
        return fut.result(timeout_s)
    except TimeoutError:
        fut.cancel()
        raise


def spawn(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run ``coro`` on the loop without waiting for it."""
    return asyncio.run_coroutine_threadsafe(coro, _Loop.get())


class Conn:
    """One client connection per server list and process, shared by every store clone and
    bus endpoint of the process."""

    def __init__(self, servers: list[str], timeout_s: float) -> None:
        import nats
        from nats.js.api import KeyValueConfig, StorageType
        from nats.js.errors import BucketNotFoundError

        self.servers = servers
        self.clones: list[Any] = []
        """Store objects torch may hold from C++ alone (kept referenced)."""
        self._waiters: dict[str, list[threading.Event]] = {}
        self._subs: dict[str, Any] = {}
        """Key -> the subscription to its writes, while someone here waits for it."""
        self._wlock = threading.Lock()
        self._probed = 0.0
        self._shunned: dict[str, float] = {}
        """Server (host:port) -> until when a reconnection passes it over."""
        self._turn = 0
        self._url = ""
        """The server (host:port) this connection is on."""
        self.leaves = 0
        """How often this connection left a server that did not answer a ping."""

        async def connect() -> tuple[Any, Any, Any]:
            async def quiet(e: Exception) -> None:  # reconnects are logged, not raised
                log.debug("nats: %s", e)

            nc = await nats.connect(
                servers=servers,
                name="fastft",
                **client_options(timeout_s),
                reconnect_to_server_handler=self._next_server,
                error_cb=quiet,
                disconnected_cb=self._left,
                reconnected_cb=self._joined,
            )
            self._url = getattr(nc.connected_url, "netloc", "")
            js = nc.jetstream(timeout=min(timeout_s, 5.0))
            kv = await with_retries(lambda: _bucket(js), timeout_s)
            if kv is None:
                for replicas in (3, 1):  # a single server cannot hold 3 replicas
                    config = KeyValueConfig(
                        bucket=BUCKET, history=1, storage=StorageType.MEMORY, replicas=replicas
                    )
                    try:
                        kv = await with_retries(lambda c=config: js.create_key_value(c), timeout_s)
                        break
                    except Exception as e:
                        if replicas == 1:
                            raise
                        log.warning(
                            "nats: the control plane's bucket gets 1 replica, not 3 (%s): "
                            "losing the server that holds it loses the job's decisions",
                            e,
                        )
            return nc, js, kv

        async def _bucket(js: Any) -> Any:
            try:
                return await js.key_value(BUCKET)
            except BucketNotFoundError:
                return None

        try:
            self.nc, self.js, self.kv = run(connect(), timeout_s + 5)
        except Exception as e:
            raise StoreUnreachable(explain(servers, e)) from e

    def waiter(self, key: str) -> threading.Event:
        """An event set when ``key`` is next written: a subscription to that key's writes
        (a JetStream write is also a core NATS message), ended by :meth:`forget` once
        nobody here waits for it. (It was one subscription to every write of the bucket,
        kept for good: every process that once waited then received every later write;
        at N members that is N pushes a write, O(N^2) a formation: issue 51.)"""
        ev = threading.Event()
        with self._wlock:
            self._waiters.setdefault(key, []).append(ev)
            start = key not in self._subs
            if start:
                self._subs[key] = None  # (taken: one subscription a key)
        if start:
            nc = self.nc

            async def on_write(msg: Any) -> None:
                with self._wlock:
                    evs = self._waiters.pop(key, [])
                for e in evs:
                    e.set()

            async def watch() -> Any:
                sub = await nc.subscribe(f"$KV.{BUCKET}.{key}", cb=on_write)
                await nc.flush()
                return sub

            sub = run(watch(), 5.0)
            with self._wlock:
                self._subs[key] = sub
        return ev

    async def _left(self) -> None:
        """The connection to its server was lost (a reset, or pings unanswered): that
        server is passed over for ``SHUN_S`` while another is there (tried again at once,
        a server cut off costs a connect timeout of seconds)."""
        if self._url:
            self._shunned[self._url] = time.monotonic() + SHUN_S

    async def _joined(self) -> None:
        self._url = getattr(self.nc.connected_url, "netloc", "")

    def _next_server(self, servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
        """nats-py's choice of the server to reconnect to: the next one around the list
        that was not left for silence within ``SHUN_S`` (any, if every one was)."""
        now = time.monotonic()
        fit = [s for s in servers if self._shunned.get(s.uri.netloc, 0.0) <= now] or servers
        self._turn += 1
        return fit[self._turn % len(fit)], RECONNECT_WAIT_S if self._turn > 1 else 0.0

    def suspect(self) -> None:
        """A call got no answer within its try: ping the server, and if it does not answer
        within ``PROBE_S`` (its link cut, or the host gone without a reset) reconnect to
        another server of the list now (at most once per ``REPROBE_S``)."""
        with self._wlock:
            now = time.monotonic()
            if now - self._probed < REPROBE_S:
                return
            self._probed = now
        nc = self.nc

        async def probe() -> bool:
            if not nc.is_connected:
                return False  # (reconnecting already)
            try:
                await nc.flush(timeout=PROBE_S)
                return False
            except Exception:
                self._shunned[url] = time.monotonic() + SHUN_S
                await nc.force_reconnect()
                return True

        url = getattr(nc.connected_url, "netloc", "?")
        try:
            left = run(probe(), PROBE_S + 1.0)
        except Exception:
            return
        if left:
            self.leaves += 1
            log.warning(
                "nats: the server at %s did not answer a ping within %.0f ms: reconnecting "
                "to another server of the list",
                url,
                PROBE_S * 1000,
            )

    def forget(self, key: str, ev: threading.Event) -> None:
        with self._wlock:
            evs = self._waiters.get(key)
            if evs is not None and ev in evs:
                evs.remove(ev)
                if not evs:
                    del self._waiters[key]
            sub = self._subs.pop(key, None) if key not in self._waiters else None
        if sub is not None:
            try:
                run(sub.unsubscribe(), 2.0)
            except Exception:
                pass  # (a closed connection has none left)

    def close(self) -> None:
        try:
            run(self.nc.close(), 2.0)
        except Exception:
            pass


@atexit.register
def shutdown() -> None:
    """Close this process's NATS connections and stop its loop (at exit, or in tests)."""
    with _CONNS_LOCK:
        conns = list(_CONNS.values())
        _CONNS.clear()
        raw = list(_PINNED)
        _PINNED.clear()
    for c in conns:
        c.close()
    for nc in raw:
        try:
            run(nc.close(), 2.0)
        except Exception:
            pass
    loop = _Loop.take()
    if loop is None:
        return

    async def cancel_rest() -> None:
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(2.0)
    except Exception:
        pass
    loop.call_soon_threadsafe(loop.stop)


_CONNS: dict[str, Conn] = {}
_CONNS_LOCK = threading.Lock()
_PINNED: list[Any] = []
"""The clients :func:`pinned` made (closed at :func:`shutdown`)."""


def pinned(servers: list[str], count: int, timeout_s: float) -> list[Any]:
    """Up to ``count`` core-NATS clients of their own, each held to one server of the list
    (round the list: one per server while there are enough), reconnecting to that server
    only; the ones that connected within ``timeout_s`` (raises StoreUnreachable if none).
    For what must reach the cluster whichever server is cut off (the node leases' beats,
    :mod:`fastft.launch.nodes.beats`): a shared client leaves a silent server only after its
    pings go unanswered (seconds)."""
    import nats

    async def one(url: str) -> Any:
        async def quiet(e: Exception) -> None:
            log.debug("nats (pinned to %s): %s", url, e)

        return await nats.connect(
            servers=[url], name="fastft-pinned", **client_options(timeout_s), error_cb=quiet
        )

    async def all_of() -> list[Any]:
        urls = [servers[i % len(servers)] for i in range(count)]
        got = await asyncio.gather(
            *(asyncio.wait_for(one(u), timeout_s) for u in urls), return_exceptions=True
        )
        for u, g in zip(urls, got, strict=True):
            if isinstance(g, BaseException):
                log.warning("nats: no connection of its own to %s (%s)", u, g)
        return [g for g in got if not isinstance(g, BaseException)]

    conns = run(all_of(), timeout_s + 2.0)
    if not conns:
        raise StoreUnreachable(f"no NATS server answers at {','.join(servers)}: check --control")
    with _CONNS_LOCK:
        _PINNED.extend(conns)
    return conns


def connection(servers: list[str], timeout_s: float, wait_s: float) -> Conn:
    """The process's connection to ``servers`` (made on first use): raises
    StoreUnreachable with one line if no server answers (within ``wait_s``) or JetStream
    is off."""
    key = ",".join(servers)
    with _CONNS_LOCK:
        conn = _CONNS.get(key)
        if conn is None:
            reachable(servers, wait_s)
            conn = _CONNS[key] = Conn(servers, timeout_s)
        return conn
