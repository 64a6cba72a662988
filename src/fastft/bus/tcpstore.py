"""TCPStore bus backend (the embedded default).

Layout in the store (names in :class:`fastft.protocol.keys.JobKeys`):

* ``bus/members``: ``id=label;id=label...``, the live subscribers, changed only by
  compare-and-set loops (join, leave, evict).
* ``bus/q/{id}``: one queue per subscriber (``queue_push``/``queue_pop``).

A broadcast reads the member set (one round trip) and pushes the message into each other
member's queue (pushes are pipelined: ~3 us each). No key is created per message, so the
key space neither grows nor wraps over a long run; queues are emptied by their readers. A
publisher counts its pushes per subscriber and every ``_CHECK_EVERY`` pushes reads the queue
length; a queue at ``max_queue`` gets its subscriber evicted and its queue drained in the
background (a TCPStore queue cannot be deleted, only emptied).

Connections are long-lived on purpose: every new TCPStore connection costs torch 2.13 a
reverse DNS lookup, which can stall for 5 s (``docs/measurements.md``, "Known limit"), so
no connection is opened on a hot path. Each endpoint uses two connections of its own (cloned from the store it is given): one for
publishing and membership, one for the listener's blocking pop, which waits up to
``idle_pop_s`` and is woken early by a sentinel pushed into its own queue at close.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastft.bus.contract import HARD_CAP, BusConfig
from fastft.bus.endpoint import WAKE, BusEndpoint
from fastft.errors import StoreTimeout, StoreUnreachable
from fastft.protocol.keys import JobKeys

if TYPE_CHECKING:  # torch is imported where a torch store is made: not by the operator's CLI
    import torch.distributed as dist

__all__ = [
    "address_toward",
    "is_local_address",
    "StoreTransport",
    "tcpstore_bus",
    "host_store",
    "connect_store",
    "parse_members",
]

log = logging.getLogger(__name__)

DRAIN_JOIN_S = 2.0
"""How long closing an endpoint waits for a drain of an evicted queue to end."""
_draining: list[threading.Thread] = []
_exiting = threading.Event()


@atexit.register
def _stop_drains() -> None:
    """At the interpreter's exit: stop the drains (each ends after the pop it is in) and
    wait for them. A process that exits while a thread is inside a store call aborts in
    C++ ("terminate called without an active exception"): a process exiting right after
    an eviction, without closing its endpoint, ended with SIGABRT (issue 25)."""
    _exiting.set()
    deadline = time.monotonic() + DRAIN_JOIN_S
    for t in list(_draining):
        t.join(max(0.0, deadline - time.monotonic()))


_CHECK_EVERY = 64


def parse_members(raw: bytes | str) -> dict[str, str]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    out: dict[str, str] = {}
    for part in text.split(";"):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = v
    return out


def _format_members(members: dict[str, str]) -> str:
    return ";".join(f"{k}={v}" for k, v in members.items())


def _timed_out(e: BaseException) -> bool:
    """Whether a store call failed because its wait ran out (torch's client or ours)."""
    if isinstance(e, StoreTimeout):
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(e, dist.DistStoreError) and "timeout" in str(e).lower()


def host_store(host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> dist.TCPStore:
    """Start a TCPStore server listening on ``host`` only (port 0: the OS picks one; read
    ``.port``). TCPStore itself listens on every interface; here it is handed a socket
    bound to ``host`` (``0.0.0.0`` or ``::`` for every interface)."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        # non-blocking, as an event loop's listener must be: on a blocking one the server's
        # loop waits inside accept() for the *next* client, and stalls the ones it has
        sock.setblocking(False)
        server = dist.TCPStore(
            host if host not in WILDCARDS else "127.0.0.1",
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the server's event loop owns the descriptor now (and closes it)
    return server


WILDCARDS = ("0.0.0.0", "::", "")


def address_toward(toward: str) -> str:
    """This host's address on the route to ``toward`` (HOST[:PORT]; no packet is sent)."""
    host = toward.split("://")[-1].split(",")[0].rpartition(":")[0] or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host.strip("[]"), 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, a wildcard, or an address one of its
    interfaces has): a socket can be bound to it."""
    if host in WILDCARDS or host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
                return True
        except OSError:
            continue
    return False


HANDSHAKE_S = 10.0
"""How long a store client waits for the store's handshake."""


def connect_store(
    address: str, timeout_s: float = 30.0, wait_s: float = 0.0, torch_free: bool = False
) -> Any:
    """Connect to ``HOST:PORT``; raises StoreUnreachable with one clear line if it can't.
    ``wait_s``: keep trying that long while nothing listens yet (an agent of another node
    may start before node 0 hosts the store); 0 fails at once. ``torch_free``: a
    :class:`~fastft.bus.storeclient.StoreClient` (enough for the bus, not for a process
    group's rendezvous) instead of torch's ``TCPStore``."""
    host, sep, port_s = address.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise StoreUnreachable(f"store address {address!r}: use HOST:PORT, e.g. 127.0.0.1:29500")
    port = int(port_s)
    deadline = time.monotonic() + wait_s
    while True:  # fail fast and quietly before TCPStore's own retry loop and C++ logging
        try:
            with socket.create_connection((host, port), timeout=min(timeout_s, 2.0)):
                break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise StoreUnreachable(
                    f"no store answers at {host}:{port} ({e.strerror or e})"
                ) from e
            time.sleep(0.05)
    if torch_free:
        from fastft.bus.storeclient import StoreClient

        return StoreClient(host, port, timeout_s=min(timeout_s, HANDSHAKE_S))
    import torch.distributed as dist

    # TCPStore's handshake has no deadline of its own against a peer that accepts and
    # never answers: build the client on a thread and give up on it after a while.
    got: list[Any] = []

    def build() -> None:
        try:
            got.append(
                dist.TCPStore(
                    host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
                )
            )
        except Exception as e:
            got.append(e)

    t = threading.Thread(target=build, name="fastft-store-connect", daemon=True)
    t.start()
    t.join(min(timeout_s, HANDSHAKE_S))
    if not got:
        raise StoreUnreachable(
            f"{host}:{port} accepts connections but does not answer as a store within "
            f"{min(timeout_s, HANDSHAKE_S):.0f} s: is it the job's store (--store)?"
        )
    if isinstance(got[0], Exception):
        first = (
            str(got[0]).strip().splitlines()[0] if str(got[0]).strip() else type(got[0]).__name__
        )
        raise StoreUnreachable(
            f"{host}:{port} did not answer as a store ({first}): is it the job's store?"
        ) from got[0]
    return got[0]


class StoreTransport:
    def __init__(self, store: Any, config: BusConfig) -> None:
        self.config = config
        self.keys = JobKeys(config.job)
        self._pub = store.clone()
        self._sub: Any = None
        self._drainer: Any = None
        self._drains: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._pushes: dict[str, int] = {}
        self._alive_seen: dict[str, tuple[bytes, float]] = {}
        self._alive_n = 0
        self._alive_t = 0.0
        self.id: str | None = None
        self.evictions = 0
        with self._lock:
            self._pub.compare_set(self.keys.bus_members, "", "")  # create if missing

    # --- membership ------------------------------------------------------------------------
    def _update(self, fn: Callable[[dict[str, str]], dict[str, str]]) -> dict[str, str]:
        key = self.keys.bus_members
        cur = self._pub.compare_set(key, "", "")
        while True:
            members = parse_members(cur)
            new = _format_members(fn(dict(members)))
            res = self._pub.compare_set(key, cur, new)
            if res == new.encode():
                return parse_members(new)
            cur = res

    def join(self, label: str) -> str:
        with self._lock:
            sid = str(self._pub.add(self.keys.bus_ids, 1))
            self._pub.set(self.keys.bus_alive(sid), "0")
            self._update(lambda m: {**m, sid: label})
            self.id = sid
        if self._sub is None:
            self._sub = self._pub.clone()
            self._sub.set_timeout(datetime.timedelta(seconds=self.config.idle_pop_s))
        return sid

    def leave(self) -> None:
        sid = self.id
        if sid is None:
            return
        with self._lock:
            self._update(lambda m: {k: v for k, v in m.items() if k != sid})
            self._drain(self._pub, self.keys.bus_queue(sid))

    def is_member(self) -> bool:
        with self._lock:
            return self.id in parse_members(self._pub.get(self.keys.bus_members))

    def evict(self, sid: str) -> None:
        """Drop subscriber ``sid`` (dead or not reading) and empty its queue."""
        with self._lock:
            self._update(lambda m: {k: v for k, v in m.items() if k != sid})
        self.evictions += 1
        log.warning("bus: evicted subscriber %s (queue reached %d)", sid, self.config.max_queue)
        if self._drainer is None:  # one long-lived connection: new ones can be slow
            self._drainer = self._pub.clone()
        drainer = self._drainer
        t = threading.Thread(
            target=self._drain,
            args=(drainer, self.keys.bus_queue(sid)),
            daemon=True,
            name=f"fastft-bus-drain-{sid}",
        )
        self._drains = [d for d in self._drains if d.is_alive()] + [t]
        _draining[:] = [d for d in _draining if d.is_alive()] + [t]
        t.start()

    @staticmethod
    def _drain(store: Any, key: str) -> None:
        try:
            for _ in range(store.queue_len(key)):
                if _exiting.is_set():
                    return
                store.queue_pop(key, block=False)
        except Exception:
            log.debug("bus: draining %s stopped", key, exc_info=True)

    # --- data ------------------------------------------------------------------------------
    def push_all(self, data: bytes) -> int:
        full: list[str] = []
        n = 0
        with self._lock:
            members = parse_members(self._pub.get(self.keys.bus_members))
            for sid in members:
                if sid == self.id:
                    continue
                key = self.keys.bus_queue(sid)
                self._pub.queue_push(key, data)
                n += 1
                count = self._pushes.get(sid, 0) + 1
                self._pushes[sid] = count
                if count % _CHECK_EVERY == 0:
                    qlen = self._pub.queue_len(key)
                    if qlen >= HARD_CAP * self.config.max_queue or (
                        qlen >= self.config.max_queue and self._stale(sid)
                    ):
                        full.append(sid)
            if len(self._pushes) > 4 * len(members) + 64:  # forget departed subscribers
                self._pushes = {k: v for k, v in self._pushes.items() if k in members}
                self._alive_seen = {k: v for k, v in self._alive_seen.items() if k in members}
        for sid in full:
            self.evict(sid)
        return n

    def _stale(self, sid: str) -> bool:
        """Whether ``sid``'s reader has not read for ``stale_s`` (its alive counter did not
        move since this publisher first saw the value). Under the transport lock."""
        key = self.keys.bus_alive(sid)
        value = bytes(self._pub.get(key)) if self._pub.check([key]) else b""
        now = time.monotonic()
        seen = self._alive_seen.get(sid)
        if seen is None or seen[0] != value:
            self._alive_seen[sid] = (value, now)
            return value == b""
        return now - seen[1] >= self.config.stale_s

    def pop(self) -> bytes | None:
        assert self._sub is not None and self.id is not None
        now = time.monotonic()
        if now - self._alive_t >= self.config.stale_s / 4:  # reading: say so, cheaply
            self._alive_n += 1
            self._alive_t = now
            self._sub.set(self.keys.bus_alive(self.id), str(self._alive_n))
        try:
            return bytes(self._sub.queue_pop(self.keys.bus_queue(self.id), block=True))
        except Exception as e:
            if _timed_out(e):
                return None
            raise

    def wake(self) -> None:
        if self.id is None:
            return
        with self._lock:
            self._pub.queue_push(self.keys.bus_queue(self.id), WAKE)

    def close(self) -> None:
        """Drop both connections now: clients must not outlive their use. A drain still
        running is waited for (at most ``DRAIN_JOIN_S``): a process that exits while a
        thread is inside a store call aborts in C++ ("terminate called without an active
        exception")."""
        for t in self._drains:
            t.join(timeout=DRAIN_JOIN_S)
        with self._lock:
            self._sub = self._drainer = None
            self._pub = None


def tcpstore_bus(store: Any, config: BusConfig) -> BusEndpoint:
    """An endpoint on ``store`` (not started). The store object is cloned, not consumed."""
    return BusEndpoint(config, StoreTransport(store, config))
