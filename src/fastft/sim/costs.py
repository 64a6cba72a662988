"""The scale model's clock and control plane: simulated time, one greenlet per simulated
process, and store clients whose every request is charged a round trip and its server's
time (:mod:`fastft.sim.scale` runs the project's real coordinator, survivors and leases
over them).

Each request leaves its client at the client's time, reaches the server half a round trip
later, waits in the server's queue (TCPStore: one thread; NATS: a write waits for the
stream's leader, a read for the server its client is connected to), is served for its
calibrated time (``src/fastft/sim/calibration.json``, ``bench/calibrate.py``), and its
answer comes back half a round trip after that. A read of a missing key waits at the
server until the key is written (each waiter woken costs the server ``wake_s``) or its
timeout runs out, as TCPStore's ``get`` does. Requests are applied in the order they reach
the server, so a compare-and-set can lose to another written between its read and its
write (NATS: ``add`` is such a loop). The run is deterministic: one process runs at a time,
and ties go by the order events were scheduled.
"""

from __future__ import annotations

import datetime
import heapq
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import greenlet
import torch.distributed as dist

__all__ = ["Hub", "ModelKV", "ModelStore", "PlaneCosts", "Server", "costs"]

CALIBRATION = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class PlaneCosts:
    """One control plane's costs, in seconds (measured by ``bench/calibrate.py``)."""

    name: str
    rtt_s: float
    set_s: float
    get_s: float
    add_s: float
    check_s: float
    compare_set_s: float
    per_key_s: float
    per_byte_s: float
    wake_s: float
    read_share_s: float
    push_s: float = 0.0
    """NATS: a write's message to one subscriber (a woken waiter then reads: a request)."""
    servers: int = 1

    @property
    def woken_s(self) -> float:
        """What one woken waiter costs the server: TCPStore answers its wait; NATS pushes
        the write's message to its subscription."""
        return self.push_s if self.servers > 1 else self.wake_s

    def scaled(self, factor: float) -> PlaneCosts:
        """Every server time ``factor`` times (a slower server; the round trip kept)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in (
            "set_s",
            "get_s",
            "add_s",
            "check_s",
            "compare_set_s",
            "per_key_s",
            "wake_s",
            "push_s",
        ):
            kw[k] *= factor
        kw["per_byte_s"] *= factor
        kw["read_share_s"] *= factor
        return PlaneCosts(**kw)


def costs(plane: str, path: Path = CALIBRATION) -> PlaneCosts:
    """The calibrated costs of ``plane`` (``tcpstore`` or ``nats``)."""
    got = json.loads(path.read_text())
    if plane not in got:
        raise ValueError(f"no calibration for {plane!r} in {path}: run bench/calibrate.py --write")
    known = {f.name for f in fields(PlaneCosts)}
    kw = {k: float(v) for k, v in got[plane].items() if k in known}
    return PlaneCosts(name=plane, servers=3 if plane == "nats" else 1, **kw)


class Server:
    """One server thread's queue: when it is next free and how long it has worked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.free = 0.0
        self.busy = 0.0

    def serve(self, arrive: float, cost: float) -> float:
        """Serve work of ``cost`` s that arrives at ``arrive``: when it is done."""
        start = max(arrive, self.free)
        self.free = start + cost
        self.busy += cost
        return self.free


@dataclass(order=True)
class _Ev:
    t: float
    seq: int
    fn: Callable[[], None]


class Hub:
    """Simulated time and the processes (greenlets) that run on it, one at a time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.main = greenlet.getcurrent()
        self.errors: list[BaseException] = []

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._q, (max(t, self.now), self._seq, fn))

    def spawn(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` as a process from time ``t`` (an exception it raises is kept)."""

        def body() -> None:
            try:
                fn()
            except greenlet.GreenletExit:
                raise
            except BaseException as e:  # noqa: BLE001 - kept for the run's report
                self.errors.append(e)

        g = greenlet.greenlet(body, parent=self.main)
        self.at(t, g.switch)

    def suspend(self) -> Any:
        """Give the turn back until :meth:`resume` (called from the hub's events)."""
        got = self.main.switch()
        if isinstance(got, BaseException):
            raise got
        return got

    def resume_at(self, t: float, g: greenlet.greenlet, value: Any = None) -> None:
        self.at(t, lambda: g.switch(value) if not g.dead else None)

    def sleep(self, s: float) -> None:
        self.resume_at(self.now + max(s, 0.0), greenlet.getcurrent())
        self.suspend()

    def clock(self) -> float:
        return self.now

    def run(self, until: float, done: Callable[[], bool] = lambda: False) -> None:
        while self._q and not done():
            t, _, fn = heapq.heappop(self._q)
            if t > until:
                heapq.heappush(self._q, (t, 0, fn))
                return
            self.now = t
            fn()


class _Waiter:
    def __init__(self, g: greenlet.greenlet) -> None:
        self.g = g
        self.done = False


class Plane:
    """The control plane's state: the keys (with a revision each), the servers, the
    waiters, and what was counted."""

    def __init__(self, hub: Hub, c: PlaneCosts) -> None:
        self.hub = hub
        self.c = c
        self.kv: dict[str, bytes] = {}
        self.rev: Counter[str] = Counter()
        self.servers = [Server(f"{c.name}{i}") for i in range(c.servers)]
        self.waiters: dict[str, list[_Waiter]] = {}
        self.ops: Counter[str] = Counter()
        self.bytes = 0
        self.rejected = 0
        """Compare-and-set writes that lost (NATS: an ``add`` tried again)."""

    @property
    def leader(self) -> Server:
        return self.servers[0]

    def busy_s(self) -> float:
        return max(s.busy for s in self.servers)

    def request(
        self,
        server: Server,
        kind: str,
        cost: float,
        apply: Callable[[], Any],
        nbytes: int = 0,
    ) -> Any:
        """One request from the calling process: applied when it reaches the server, the
        answer back after its service; ``apply`` returns the answer (an exception is raised
        in the caller) or ``_WAIT`` to wait at the server for a key (``apply`` is then
        called again when the key is written)."""
        hub, g = self.hub, greenlet.getcurrent()
        self.ops[kind] += 1

        def serve() -> None:
            got = apply()
            size = nbytes + (len(got) if isinstance(got, bytes) else 0)
            if isinstance(got, tuple) and isinstance(got[0], bytes):  # (NATS: and a revision)
                size += len(got[0])
            if isinstance(got, list):
                size += sum(len(v) for v in got if isinstance(v, bytes))
            self.bytes += size
            done = server.serve(hub.now, cost + size * self.c.per_byte_s)
            hub.resume_at(done + self.c.rtt_s / 2, g, got)

        hub.at(hub.now + self.c.rtt_s / 2, serve)
        return hub.suspend()

    def wait_key(self, server: Server, key: str, timeout_s: float) -> None:
        """A request that returns when ``key`` exists (TCPStore's wait; a NATS watch), or
        raises DistStoreError after ``timeout_s``."""
        hub, g = self.hub, greenlet.getcurrent()
        self.ops["wait"] += 1

        def serve() -> None:
            if key in self.kv:
                hub.resume_at(server.serve(hub.now, self.c.check_s) + self.c.rtt_s / 2, g)
                return
            w = _Waiter(g)
            self.waiters.setdefault(key, []).append(w)

            def expire() -> None:
                if not w.done:
                    w.done = True
                    self.ops["wait_timeout"] += 1
                    g.switch(dist.DistStoreError(f"timeout waiting for key {key!r}"))

            hub.at(hub.now + timeout_s, expire)

        hub.at(hub.now + self.c.rtt_s / 2, serve)
        hub.suspend()

    def written(self, key: str, server: Server) -> None:
        """``key`` was written: wake its waiters (each a push from ``server``)."""
        self.rev[key] += 1
        for w in self.waiters.pop(key, []):
            if not w.done:
                w.done = True
                self.ops["woken"] += 1
                done = server.serve(self.hub.now, self.c.woken_s)
                self.hub.resume_at(done + self.c.rtt_s / 2, w.g)


_MISSING = object()


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class ModelStore:
    """A TCPStore client on the model's plane (the calls the coordinator, the survivors
    and the leases make)."""

    def __init__(self, plane: Plane, home: int = 0, timeout_s: float = 300.0) -> None:
        self.p = plane
        self.home = plane.servers[home % len(plane.servers)]
        self.timeout_s = timeout_s

    def clone(self) -> ModelStore:
        return type(self)(self.p, self.p.servers.index(self.home), self.timeout_s)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def _w(self) -> Server:
        """Where a write is ordered (TCPStore: its one thread; NATS: the stream's leader)."""
        return self.home if self.p.c.servers == 1 else self.p.leader

    def _put(self, key: str, value: bytes) -> None:
        self.p.kv[key] = value
        self.p.written(key, self._w())

    def set(self, key: str, value: str | bytes) -> None:
        v = _b(value)
        self.p.request(self._w(), "set", self.p.c.set_s, lambda: self._put(key, v), len(v))

    def get(self, key: str) -> bytes:
        self.p.wait_key(self.home, key, self.timeout_s)
        return self.p.request(self.home, "get", self.p.c.get_s, lambda: self.p.kv[key])

    def add(self, key: str, amount: int) -> int:
        def apply() -> int:
            n = int(self.p.kv.get(key, b"0")) + amount
            self._put(key, str(n).encode())
            return n

        return self.p.request(self._w(), "add", self.p.c.add_s, apply)

    def check(self, keys: list[str]) -> bool:
        cost = self.p.c.check_s + self.p.c.per_key_s * (len(keys) - 1)
        return self.p.request(self.home, "check", cost, lambda: all(k in self.p.kv for k in keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        for k in keys:
            if k not in self.p.kv:
                self.p.wait_key(self.home, k, self.timeout_s)
        cost = self.p.c.get_s + self.p.c.per_key_s * (len(keys) - 1)
        return self.p.request(self.home, "multi_get", cost, lambda: [self.p.kv[k] for k in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        want, new = _b(expected), _b(desired)

        def apply() -> bytes:
            cur = self.p.kv.get(key)
            if (cur is None and want == b"") or cur == want:
                self._put(key, new)
                return new
            self.p.rejected += 1
            return cur if cur is not None else want

        return self.p.request(self._w(), "compare_set", self.p.c.compare_set_s, apply, len(new))

    def delete_key(self, key: str) -> bool:
        return self.p.request(
            self._w(), "delete", self.p.c.set_s, lambda: self.p.kv.pop(key, None) is not None
        )


class ModelKV(ModelStore):
    """A NATS key-value client (:class:`fastft.bus.nats.NatsKV`'s requests) on the model's
    plane: a read goes to the client's server, a write to the stream's leader; ``add`` and
    a compare-and-set read the key's revision and write expecting it (a write that lost
    is tried again: counted as rejected); ``read_many`` is one round trip of reads."""

    def _read(self, key: str) -> tuple[bytes | None, int]:
        got = self.p.request(
            self.home, "get", self.p.c.get_s, lambda: (self.p.kv.get(key), self.p.rev[key])
        )
        return got

    def _write_if(self, key: str, value: bytes, rev: int) -> bool:
        def apply() -> bool:
            if self.p.rev[key] != rev:
                self.p.rejected += 1
                return False
            self._put(key, value)
            return True

        return self.p.request(self.p.leader, "write", self.p.c.set_s, apply, len(value))

    def get(self, key: str) -> bytes:
        v, _ = self._read(key)
        if v is None:  # (a subscription to the key's writes, then the wait, then a read)
            self.p.request(self.home, "subscribe", self.p.c.push_s, lambda: None)
            try:
                self.p.wait_key(self.home, key, self.timeout_s)
            except dist.DistStoreError:
                v, _ = self._read(key)  # (NatsKV reads once more before it gives up)
                if v is None:
                    raise
            v, _ = self._read(key)
        assert v is not None
        return v

    def add(self, key: str, amount: int) -> int:
        while True:
            v, rev = self._read(key)
            n = int(v or b"0") + amount
            if self._write_if(key, str(n).encode(), rev):
                return n

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        want, new = _b(expected), _b(desired)
        if not want and self._write_if(key, new, 0):
            return new
        while True:
            v, rev = self._read(key)
            if v is None and want:
                return want
            cur = v or b""
            if v is not None and cur != want:
                return cur
            if self._write_if(key, new, rev):
                return new

    def check(self, keys: list[str]) -> bool:
        return all(self._read(k)[0] is not None for k in keys)

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        cost = self.p.c.get_s + self.p.c.per_key_s * (len(keys) - 1)
        return self.p.request(
            self.home, "read_many", cost, lambda: [self.p.kv.get(k) for k in keys]
        )

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = self.read_many(keys)
        return [v if v is not None else self.get(k) for v, k in zip(got, keys, strict=True)]
