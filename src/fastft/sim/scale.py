"""The scale model (issue 51): the project's real control-plane code for thousands of
members on simulated time, over a calibrated model of the TCPStore or NATS servers
(:mod:`fastft.sim.costs`). Deterministic, seconds a run.

Three scenarios, each the real code paths a job runs:

- ``reform``: N members in epoch 1, one dies; its agent's exit notice reaches every node
  over the bus (a push per node from the server: the relay, a node's one subscriber, from
  64 workers); each survivor runs :meth:`Survivors.rounds` (arrive, the closer's rounds,
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
from typing import Any

import greenlet

from fastft.runtime.contract import REGROUP_TIMEOUT_S, EpochView, Member
from fastft.runtime.engine.coordinator import form_wait_s
from fastft.runtime.engine.joiners import Joiners
from fastft.runtime.engine.survivors import Survivors
from fastft.sim.costs import Cores
from fastft.sim.scalejob import Result, ScaleJob, finish, memo
from fastft.sim.scalevoice import ModelVoice

__all__ = ["Result", "leases", "memo", "reform", "start"]

RELAY_FROM = 64
"""The bus relay's threshold (``--bus-relay auto``: a node's agent is its one subscriber)."""
HOP_S = 0.0002
"""A relayed frame's hop from the agent to a worker (a Unix socket)."""
ROLLBACK_S = 0.001
"""From the notice to the arrival: the interrupt and the rollback."""


def _first_epoch(job: ScaleJob, n: int) -> EpochView:
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
    voice: bool | None = None,
    host: tuple[int, float] | None = None,
) -> Result:
    """One fault among ``n`` members (rank ``dead``), every survivor into epoch 2.
    ``voice``: each node's agent speaks for its workers (:mod:`fastft.sim.scalevoice`);
    by default where the bus relay is on (``--bus-relay auto``: from 64 workers).
    ``host``: ``(cores, cpu_s)``, every member on one host of that many cores, each
    spending ``cpu_s`` of CPU on the formation (half as it takes in the notice, half as it
    takes in the closed view), as the real servers' harness runs them (``bench/barrier.py``
    measures ``cpu_s``); by default each member on a host of its own, its CPU a latency
    (:data:`ROLLBACK_S`)."""
    job = ScaleJob(plane, n, slow=slow, secret=secret)
    hub = job.hub
    view = _first_epoch(job, n)
    done: list[float] = []
    tries: list[int] = []
    declared: set[int] = set()
    holders: dict[int, int] = {}
    live = [r for r in range(n) if r != dead]
    nodes = -(-n // per_node)
    relay = n >= RELAY_FROM
    voice = relay if voice is None else voice
    voices = [
        ModelVoice(job, node, sum(1 for r in live if r // per_node == node), form_wait_s(n))
        for node in range(nodes)
    ] if voice else []  # fmt: skip

    def bus_push(targets: int) -> list[float]:
        """A broadcast: when each of ``targets`` subscribers has it (one push each)."""
        return [job.p.servers[0].serve(hub.now, job.c.woken_s) for _ in range(targets)]

    def remind() -> None:  # (a rollback request: one broadcast)
        bus_push(nodes if relay else n)

    cores = Cores(host[0]) if host else None

    def cpu() -> None:  # (half the member's CPU on the host's cores, when one is free)
        if cores is not None and host is not None:
            hub.sleep(cores.run(hub.now, host[1] / 2) - hub.now)

    def member(r: int) -> None:
        greenlet.getcurrent().rank = r  # (its requests: the critical path's, for the closer)
        cpu()
        coord = job.coordinator(r, 1, tries, dead={Member(dead, 1)})
        if r == 0:  # (rank 0 closed the first start: it made the joiner keys)
            coord.joiner_keys_made()
        if voices:
            coord.voice = voices[r // per_node]
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
        cpu()
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
    return finish(
        job.result(
            "reform",
            done,
            len(live),
            critical=crit,
            closers=len(set(tries)),
            false_deaths=len(declared & set(live)),
            nodes=nodes,
            voice=voice,
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
    job = ScaleJob(plane, n, slow=slow, secret=secret)
    hub = job.hub
    rng = random.Random(seed)
    done: list[float] = []
    tries: list[int] = []

    def worker(r: int) -> None:
        coord = job.coordinator(r, n, tries)
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
    return finish(
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
    beats: str = "auto",
) -> Result:
    """``k`` node agents' lease rounds for ``seconds`` (after every agent started): on a
    TCPStore the store's counters (:class:`~fastft.launch.nodes.lease.NodeLease`), on NATS
    core beats with the bucket's marks read as a backstop
    (:class:`~fastft.launch.nodes.beatlease.BeatLease`, :mod:`fastft.sim.scalebeats`);
    ``beats``: a TCPStore's ``--node-beats`` (``peers``: from agent to agent,
    :class:`~fastft.launch.nodes.peerbeats.PeerLease`)."""
    from fastft.launch.nodes.beatlease import BeatLease
    from fastft.launch.nodes.lease import NodeLease
    from fastft.launch.nodes.peerbeats import PeerLease, peer_beats
    from fastft.launch.rules.leasewatch import NATS_STORE_GRACE_S, LeaseConfig, watched
    from fastft.sim.scalebeats import ModelBeats, ModelPeerBeats

    job = ScaleJob(plane, k, slow=slow, secret=True)
    hub = job.hub
    grace = NATS_STORE_GRACE_S if job.c.servers > 1 else None  # (as an agent's)
    cfg = LeaseConfig(heartbeat_ms=heartbeat_ms, misses=misses, store_grace_s=grace)
    lost: list[int] = []
    rounds: list[float] = []
    renewals: list[int] = []
    built: list[int] = []
    window: list[float] = []  # (its start once every agent is built; the busy then)
    busy: dict[str, list[float]] = {}

    def snap(at: str) -> None:
        busy[at] = [s.busy for s in job.p.threads()]

    class Stop:
        def is_set(self) -> bool:
            return bool(window) and hub.now >= window[0] + seconds

        def wait(self, s: float) -> bool:
            hub.sleep(s)
            return self.is_set()

        def set(self) -> None:
            pass

    peers: dict[int, ModelPeerBeats] = {}

    def renewer(own: ModelBeats | ModelPeerBeats) -> None:  # (a real agent's Renewer thread)
        stop = Stop()
        while not stop.is_set():
            own.renew()
            stop.wait(cfg.period_s)

    def nats_beats(node: int) -> ModelBeats:
        auth = job.auth
        assert auth is not None  # (ScaleJob(secret=True))
        return ModelBeats(job.p, node, job.keys.job, node, auth.sign, auth.verify, hub.clock)

    def agent(node: int) -> None:
        kind: Any = NodeLease
        later = lambda name, fn: hub.spawn(hub.now, fn)  # noqa: E731
        if job.c.servers > 1:  # (a mark's write: a process of its own, as a thread is)
            kind = functools.partial(BeatLease, beats=nats_beats(node), spawn=later)
        elif peer_beats(beats, k):
            auth = job.auth
            assert auth is not None
            own = ModelPeerBeats(
                job.p, job.client(node), peers, job.keys, node, auth.sign, auth.verify, hub.clock
            )
            kind = functools.partial(PeerLease, beats=own, spawn=later)
        lease = kind(
            job.client(node),
            job.keys,
            node,
            k,
            cfg,
            on_lost=lambda n, lives, at: lost.append(n),
            on_fenced=lambda mark: None,
            on_store_lost=lambda why, silent: lost.append(-1),
            clock=hub.clock,
        )

        def timed(began: float, ended: float) -> None:
            if window and began >= window[0]:
                rounds.append(ended - began)

        if isinstance(lease, BeatLease):  # (its start(), in simulated time; peers too)
            own_beats: Any = lease.beats
            if isinstance(own_beats, ModelPeerBeats):
                own_beats.listen()
            own_beats.watch(watched(node, k, {}, lease.watchers))
            hub.spawn(hub.now, functools.partial(renewer, own_beats))
            hub.spawn(hub.now, functools.partial(lease.marks_rounds, Stop()))
        built.append(node)
        if len(built) == k:  # (the window: once every agent made its keys, which on NATS
            window.append(hub.now + 0.5)  # are JetStream writes: seconds at 2,048)
            hub.at(window[0], lambda: snap("start"))
            hub.at(window[0] + seconds, lambda: snap("end"))
        lease.rounds(Stop(), on_read=timed)  # (from its start, as an agent's)
        renewals.append(lease.renewals)

    rng = random.Random(0)
    for node in range(k):
        hub.spawn(rng.uniform(0, 0.5), functools.partial(agent, node))
    hub.run(3600.0, lambda: len(renewals) == k or bool(hub.errors))
    if hub.errors:
        raise hub.errors[0]
    end = window[0] + seconds
    used, busiest = max(
        (e - s, t.name) for s, e, t in zip(busy["start"], busy["end"], job.p.threads(), strict=True)
    )
    rounds.sort()
    pct = (lambda q: round(rounds[min(len(rounds) - 1, int(q * len(rounds)))] * 1e3, 2)) if rounds else (lambda q: None)  # fmt: skip
    return finish(
        job.result(
            "leases",
            [end] * len(renewals),
            k,
            false_deaths=len(lost),
            read_p50_ms=pct(0.5),
            read_p99_ms=pct(0.99),
            rounds_per_s=round(len(rounds) / k / seconds, 2),
            utilisation=round(used / seconds, 3),
            busiest=busiest,
            beats=job.p.ops["message"],
            store_reads=job.p.ops["read_many"] + job.p.ops["multi_get"],
        )
    )
