"""The scale model (issue 51): the project's real control-plane code for thousands of
members on simulated time, over a calibrated model of the TCPStore or NATS servers
(:mod:`fastft.sim.costs`). Deterministic, seconds a run.

Three scenarios, each the real code paths a job runs:

- ``reform``: N members in epoch 1, one dies; its agent's exit notice reaches every node
  over the bus (a push per node from the server: the relay, a node's one subscriber, from
  64 workers); each survivor runs :meth:`Survivors.form` (arrive, the closer's rounds,
  the blocking wait for the closed view) until it holds epoch 2.
- ``start``: N workers start over ``spread_s`` and run :meth:`Joiners.rounds`
  until each holds epoch 1.
- ``leases``: K node agents run :class:`~fastft.launch.nodes.lease.NodeLease`'s rounds (renew,
  read the watched nodes) for ``seconds``.

Reported: when the last member was done, the busiest server's time (its one thread, or
NATS's stream leader), requests (all, per member, and the closer's from its arrival to the
close: the critical path's round trips in a row), bytes through the servers, rejected
compare-and-set writes, blocking reads that timed out and polled again, members that
tried to close the epoch, and members declared dead while alive.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import greenlet

from fastft.bus.signed import SignedStore
from fastft.protocol.auth import JobSecret, ValueAuth
from fastft.protocol.keys import JobKeys
from fastft.runtime.contract import REGROUP_TIMEOUT_S, EpochView, Member
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.joiners import Joiners
from fastft.runtime.engine.survivors import Survivors
from fastft.sim.costs import Hub, ModelKV, ModelStore, Plane, PlaneCosts, costs

__all__ = ["Result", "leases", "memo", "reform", "start"]

RELAY_FROM = 64
"""The bus relay's threshold (``--bus-relay auto``: a node's agent is its one subscriber)."""
HOP_S = 0.0002
"""A relayed frame's hop from the agent to a worker (a Unix socket)."""
ROLLBACK_S = 0.001
"""From the notice to the arrival: the interrupt and the rollback."""


@dataclass
class Result:
    scenario: str
    plane: str
    members: int
    done_s: float | None
    """When the last member was done (None: not within the horizon)."""
    server_busy_s: float
    requests: int
    requests_per_member: float
    critical_requests: int
    mbytes: float
    rejected: int
    repolls: int
    closers: int
    false_deaths: int
    errors: int
    model_wall_s: float
    extra: dict[str, Any]

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return {**d, **self.extra}


def _bytes(raw: str | bytes) -> bytes:
    return raw.encode() if isinstance(raw, str) else bytes(raw)


@contextmanager
def memo() -> Iterator[None]:
    """Within a run, a view or a signed value read by every member is decoded once (what
    is modelled is the servers' time; N members each decoding an N-member view here would
    cost the model O(N^2) of its own time, not the job's)."""
    views = functools.lru_cache(maxsize=64)(EpochView.from_json.__func__)  # type: ignore[attr-defined]
    verify = ValueAuth.verify
    checked = functools.lru_cache(maxsize=1 << 16)(lambda self, key, raw: verify(self, key, raw))
    change = EpochView.from_change.__func__  # type: ignore[attr-defined]
    changes: dict[tuple[int, bytes], Any] = {}

    def from_change(cls: type, prev: EpochView, raw: str | bytes) -> Any:
        key = (id(prev), _bytes(raw))
        if key not in changes:
            changes[key] = change(cls, prev, raw)
        return changes[key]

    EpochView.from_json = classmethod(lambda cls, raw: views(cls, _bytes(raw)))  # type: ignore[assignment,method-assign,arg-type]
    EpochView.from_change = classmethod(from_change)  # type: ignore[assignment,method-assign]
    ValueAuth.verify = lambda self, key, raw: checked(self, key, _bytes(raw))  # type: ignore[method-assign]
    try:
        yield
    finally:
        EpochView.from_json = classmethod(views.__wrapped__)  # type: ignore[assignment,method-assign]
        EpochView.from_change = classmethod(change)  # type: ignore[assignment,method-assign]
        ValueAuth.verify = verify  # type: ignore[method-assign]


class _Job:
    """One model run's plane, keys, secret and per-process request counts."""

    def __init__(self, plane: str, n: int, *, slow: float, secret: bool) -> None:
        self.hub = Hub()
        self.c: PlaneCosts = costs(plane).scaled(slow)
        self.p = Plane(self.hub, self.c)
        self.keys = JobKeys("scale")
        self.auth = ValueAuth(JobSecret(b"s" * 32)) if secret else None
        self.n = n
        self.t0 = time.perf_counter()
        self.by_proc: dict[Any, int] = {}
        base = self.p.request

        def counted(*a: Any, **kw: Any) -> Any:
            g = greenlet.getcurrent()
            self.by_proc[g] = self.by_proc.get(g, 0) + 1
            return base(*a, **kw)

        self.p.request = counted  # type: ignore[method-assign]

    def client(self, i: int, timeout_s: float = 300.0) -> Any:
        kind = ModelKV if self.c.servers > 1 else ModelStore
        raw = kind(self.p, home=i, timeout_s=timeout_s)
        return SignedStore(raw, self.keys, self.auth) if self.auth is not None else raw

    def put(self, key: str, value: str) -> None:
        """A key as the job left it (no cost: before the scenario)."""
        if self.auth is not None and self.keys.signed(key):
            value = self.auth.sign(key, value)
        self.p.kv[key] = value.encode()

    def result(self, scenario: str, done: list[float], expected: int, **kw: Any) -> Result:
        return Result(
            scenario=scenario,
            plane=self.c.name,
            members=self.n,
            done_s=round(max(done), 4) if len(done) == expected else None,
            server_busy_s=round(self.p.busy_s(), 4),
            requests=sum(self.p.ops.values()) - self.p.ops["woken"] - self.p.ops["wait_timeout"],
            requests_per_member=0.0,
            critical_requests=kw.pop("critical", 0),
            mbytes=round(self.p.bytes / 1e6, 3),
            rejected=self.p.rejected,
            repolls=self.p.ops["wait_timeout"],
            closers=kw.pop("closers", 0),
            false_deaths=kw.pop("false_deaths", 0),
            errors=len(self.hub.errors),
            model_wall_s=round(time.perf_counter() - self.t0, 2),
            extra=kw,
        )


def _finish(r: Result) -> Result:
    r.requests_per_member = round(r.requests / max(r.members, 1), 2)
    return r


class _Closes(Coordinator):
    """The real coordinator, its closes counted (and a NATS closer's joiner keys cleared
    32 at a time by processes of the model, as the coordinator's thread pool does)."""

    tries: list[int]
    hub: Hub

    def close(
        self, view: EpochView, admitted: dict[int, int], prev: EpochView | None = None
    ) -> EpochView:
        self.tries.append(self.me.rank)
        return super().close(view, admitted, prev)

    def clear_joiners(self, admitted: dict[int, int]) -> None:
        if not (self.reads_many and len(admitted) > 1):
            return super().clear_joiners(admitted)
        hub: Hub = self.hub
        left = [len(admitted)]
        me = greenlet.getcurrent()
        items = list(admitted.items())
        width = 32  # (coordinator._CLEARERS: that many at once, as its thread pool)

        def clear(chunk: list[tuple[int, int]]) -> None:
            for r, inc in chunk:
                self.store.compare_set(self.keys.joiner(r), str(inc), "")
                left[0] -= 1
            if left[0] == 0:
                hub.resume_at(hub.now, me)

        for i in range(width):
            hub.spawn(hub.now, functools.partial(clear, items[i::width]))
        hub.suspend()


def _first_epoch(job: _Job, n: int) -> EpochView:
    """The store after a first start of ``n`` members: epoch 1 closed, every joiner key
    cleared."""
    keys = job.keys
    view = EpochView(1, tuple(Member(r, 1) for r in range(n)), 0, frozenset(), None)
    job.put(keys.epoch_members(1), view.to_json())
    job.put(keys.latest_epoch, "1")
    job.put(keys.joined, str(n))
    for r in range(n):
        job.put(keys.joiner(r), "")
    return view


def reform(
    n: int,
    plane: str = "tcpstore",
    *,
    dead: int = 0,
    per_node: int = 8,
    slow: float = 1.0,
    secret: bool = True,
    timeout_s: float = 5.0,
    horizon_s: float = 120.0,
) -> Result:
    """One fault among ``n`` members (rank ``dead``), every survivor into epoch 2."""
    job = _Job(plane, n, slow=slow, secret=secret)
    hub, keys = job.hub, job.keys
    view = _first_epoch(job, n)
    done: list[float] = []
    tries: list[int] = []
    declared: set[int] = set()
    holders: dict[int, int] = {}
    live = [r for r in range(n) if r != dead]
    nodes = -(-n // per_node)
    relay = n >= RELAY_FROM

    def bus_push(targets: int) -> list[float]:
        """A broadcast: when each of ``targets`` subscribers has it (one push each)."""
        return [job.p.servers[0].serve(hub.now, job.c.woken_s) for _ in range(targets)]

    def remind() -> None:  # (a rollback request: one broadcast)
        bus_push(nodes if relay else n)

    def member(r: int) -> None:
        greenlet.getcurrent().rank = r  # (its requests: the critical path's, for the closer)
        coord = _Closes(
            job.client(r),
            keys,
            r,
            1,
            n,
            1,
            dead={Member(dead, 1)},
            clock=hub.clock,
            sleep=hub.sleep,
            decision_store=job.client(r, 0.5),
        )
        coord.tries, coord.hub = tries, hub
        if r == 0:  # (rank 0 closed the first start: it made the joiner keys)
            coord.joiner_keys_made()
        survivors = Survivors(coord)
        wait = survivors.arrive(
            view, frozenset({dead}), step=0, lost_state=False, timeout_s=timeout_s
        )
        got = None
        for rd in survivors.rounds(wait):  # (the worker's executor carries out each round)
            declared.update(rd.silent)
            if rd.remind:
                remind()
            got = rd.view
        assert got is not None and got.epoch == 2
        holders[got.epoch] = holders.get(got.epoch, 0) + 1
        done.append(hub.now)

    arrive = bus_push(nodes if relay else len(live))
    for r in live:
        t = arrive[r // per_node] + HOP_S if relay else arrive[live.index(r)]
        hub.spawn(t + job.c.rtt_s / 2 + ROLLBACK_S, functools.partial(member, r))
    hub.run(horizon_s, lambda: len(done) == len(live) or bool(hub.errors))
    if hub.errors:
        raise hub.errors[0]
    closer = min((r for r in live if r not in declared), default=-1)
    crit = next((c for g, c in job.by_proc.items() if getattr(g, "rank", None) == closer), 0)
    return _finish(
        job.result(
            "reform",
            done,
            len(live),
            critical=crit,
            closers=len(set(tries)),
            false_deaths=len(declared & set(live)),
            nodes=nodes,
        )
    )


def start(
    n: int,
    plane: str = "tcpstore",
    *,
    spread_s: float = 1.0,
    slow: float = 1.0,
    secret: bool = True,
    horizon_s: float = 300.0,
    seed: int = 0,
) -> Result:
    """The first start: ``n`` workers register over ``spread_s`` and form epoch 1."""
    job = _Job(plane, n, slow=slow, secret=secret)
    hub, keys = job.hub, job.keys
    rng = random.Random(seed)
    done: list[float] = []
    tries: list[int] = []

    def worker(r: int) -> None:
        coord = _Closes(
            job.client(r),
            keys,
            r,
            1,
            n,
            n,
            clock=hub.clock,
            sleep=hub.sleep,
            decision_store=job.client(r, 0.5),
        )
        coord.tries, coord.hub = tries, hub
        joiners = Joiners(coord)
        wait = joiners.register(300.0, REGROUP_TIMEOUT_S)
        got = None
        for jr in joiners.rounds(wait):  # (a join request goes nowhere: no epoch lives yet)
            got = jr.view
        assert got is not None
        done.append(hub.now)

    for r in range(n):
        hub.spawn(rng.uniform(0, spread_s), functools.partial(worker, r))
    hub.run(horizon_s, lambda: len(done) == n or bool(hub.errors))
    if hub.errors:
        raise hub.errors[0]
    return _finish(
        job.result(
            "start",
            done,
            n,
            closers=len(set(tries)),
            after_last_start_s=round(max(done) - spread_s, 4) if len(done) == n else None,
        )  # fmt: skip
    )


def leases(
    k: int,
    plane: str = "tcpstore",
    *,
    seconds: float = 5.0,
    slow: float = 1.0,
    heartbeat_ms: int = 100,
    misses: int = 3,
) -> Result:
    """``k`` node agents' lease rounds for ``seconds`` (after every agent started)."""
    from fastft.launch.nodes.lease import NodeLease
    from fastft.launch.rules.leasewatch import LeaseConfig

    job = _Job(plane, k, slow=slow, secret=True)
    hub, keys = job.hub, job.keys
    cfg = LeaseConfig(heartbeat_ms=heartbeat_ms, misses=misses)
    lost: list[int] = []
    rounds: list[float] = []
    renewals: list[int] = []
    end = 1.0 + seconds

    class Stop:
        def is_set(self) -> bool:
            return hub.now >= end

        def wait(self, s: float) -> bool:
            hub.sleep(s)
            return self.is_set()

        def set(self) -> None:
            pass

    def agent(node: int) -> None:
        lease = NodeLease(
            job.client(node),
            keys,
            node,
            k,
            cfg,
            on_lost=lambda n, lives, at: lost.append(n),
            on_fenced=lambda mark: None,
            on_store_lost=lambda why, silent: lost.append(-1),
            clock=hub.clock,
        )

        def timed(began: float, ended: float) -> None:
            if began >= 1.0:
                rounds.append(ended - began)

        hub.sleep(max(0.0, 1.0 - hub.now))  # (every agent starts its rounds together)
        lease.rounds(Stop(), on_read=timed)
        renewals.append(lease.renewals)

    rng = random.Random(0)
    for node in range(k):
        hub.spawn(rng.uniform(0, 0.5), functools.partial(agent, node))
    hub.run(end + 1.0, lambda: len(renewals) == k or bool(hub.errors))
    if hub.errors:
        raise hub.errors[0]
    rounds.sort()
    pct = (lambda q: round(rounds[min(len(rounds) - 1, int(q * len(rounds)))] * 1e3, 2)) if rounds else (lambda q: None)  # fmt: skip
    return _finish(
        job.result(
            "leases",
            [end] * len(renewals),
            k,
            false_deaths=len(lost),
            read_p50_ms=pct(0.5),
            read_p99_ms=pct(0.99),
            rounds_per_s=round(len(rounds) / k / seconds, 2),
            utilisation=round(job.p.busy_s() / end, 3),
        )
    )
