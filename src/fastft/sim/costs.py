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

import functools
import heapq
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import greenlet
import torch.distributed as dist

__all__ = ["Cores", "Hub", "Plane", "PlaneCosts", "Server", "Watch", "costs"]

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


class Cores:
    """A host's cores, shared by the processes on it: a piece of CPU work runs on the core
    that is free first (the real servers' harness runs hundreds of members on one
    machine's few cores; a job runs a few on each host)."""

    def __init__(self, n: int) -> None:
        self.cores = [Server(f"core{i}") for i in range(n)]

    def run(self, at: float, cost: float) -> float:
        """When CPU work of ``cost`` s, ready at ``at``, is done."""
        return min(self.cores, key=lambda c: max(c.free, at)).serve(at, cost)


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


class Watch:
    """A subscription to every write of the keys under ``prefix`` (NATS KV's watch of a
    subject's last values and its new ones): each pushed by the client's server, here
    when its push arrived."""

    def __init__(self, prefix: str, server: Server) -> None:
        self.prefix = prefix
        self.server = server
        self.seen: dict[str, bytes] = {}
        self.closed = False

    def values(self) -> dict[str, bytes]:
        return self.seen

    def close(self) -> None:
        self.closed = True


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
        self.watches: list[Watch] = []
        self.subs: dict[str, list[tuple[Server, Callable[[bytes], None]]]] = {}
        """Core-NATS subscriptions by subject: each subscriber's server and callback."""
        self.cores = {id(s): Server(f"{s.name}-core") for s in self.servers}
        """Each server's core-NATS routing: its clients' connections' own goroutines in a
        real server, never queued behind the stream's writes (a write waits for its
        replicas; a message is handed on at once)."""

    @property
    def leader(self) -> Server:
        return self.servers[0]

    def busy_s(self) -> float:
        return max(s.busy for s in self.threads())

    def threads(self) -> list[Server]:
        """Every queue of work: each server's, and its core routing's."""
        return [*self.servers, *self.cores.values()]

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

    def subscribe(self, server: Server, subject: str, cb: Callable[[bytes], None]) -> None:
        """A core-NATS subscription of a client of ``server`` (one request)."""
        self.request(
            server, "subscribe", self.c.push_s, lambda: self.subs.setdefault(subject, []).append((server, cb))
        )  # fmt: skip

    def publish(self, server: Server, subject: str, data: bytes) -> None:
        """A core-NATS message from a client of ``server``, which does not wait: taken in
        by its server, then pushed by each subscriber's (routed there first when that is
        another server)."""
        hub, c = self.hub, self.c
        self.ops["message"] += 1
        size = len(data) * c.per_byte_s

        def routed(core: Server, cb: Callable[[bytes], None]) -> None:
            done = core.serve(hub.now, 2 * (c.push_s + size))  # (taken in, then pushed)
            hub.at(done + c.rtt_s / 2, functools.partial(cb, data))

        def arrive() -> None:
            home = self.cores[id(server)]
            taken = home.serve(hub.now, c.push_s + size)
            for srv, cb in self.subs.get(subject, []):
                self.ops["pushed"] += 1
                core = self.cores[id(srv)]
                if core is home:  # (its queue's next: no later arrival goes before it)
                    done = home.serve(taken, c.push_s + size)
                    hub.at(done + c.rtt_s / 2, functools.partial(cb, data))
                else:  # (a server serves in the order work arrives: there, at its time)
                    hub.at(taken + c.rtt_s / 2, functools.partial(routed, core, cb))

        hub.at(hub.now + c.rtt_s / 2, arrive)

    def wait_key(self, server: Server, key: str, timeout_s: float) -> None:
        """A request that returns when ``key`` exists (TCPStore's wait; a NATS watch), or
        raises DistStoreError after ``timeout_s``."""
        hub, g = self.hub, greenlet.getcurrent()
        self.ops["wait"] += 1

        def serve() -> None:
            if key in self.kv:  # (TCPStore answers the wait; on NATS the client's
                # subscription made it, and its read after it is a request of its own)
                cost = self.c.check_s if self.c.servers == 1 else self.c.push_s
                hub.resume_at(server.serve(hub.now, cost) + self.c.rtt_s / 2, g)
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

    def push(self, w: Watch, key: str) -> None:
        """``key``'s value to watch ``w`` (a message from its server)."""
        value = self.kv[key]
        self.ops["pushed"] += 1
        done = w.server.serve(self.hub.now, self.c.push_s + len(value) * self.c.per_byte_s)
        self.hub.at(done + self.c.rtt_s / 2, lambda: w.seen.__setitem__(key, value))

    def written(self, key: str, server: Server) -> None:
        """``key`` was written: wake its waiters (each a push from ``server``), and push it
        to the watches of its prefix."""
        self.rev[key] += 1
        if self.watches:
            self.watches = [w for w in self.watches if not w.closed]
            for watch in self.watches:
                if key.startswith(watch.prefix):
                    self.push(watch, key)
        for w in self.waiters.pop(key, []):
            if not w.done:
                w.done = True
                self.ops["woken"] += 1
                done = server.serve(self.hub.now, self.c.woken_s)
                self.hub.resume_at(done + self.c.rtt_s / 2, w.g)
