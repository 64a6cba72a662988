"""The node's bus relay (fastft.bus.relay): the agent is its node's one subscriber and its
workers receive from it; the bus contract still holds, on the memory bus and a real
TCPStore, and the store sees one subscriber per node."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from fastft.bus import BusConfig, MemoryHub, RelayHub, host_store, open_bus
from fastft.bus.endpoint import BusEndpoint
from fastft.bus.hubtransport import HubTransport
from fastft.bus.memory import MemoryTransport
from fastft.bus.relay import HELLO_MAX, sockaddr
from fastft.bus.relayed import RelayedTransport
from fastft.bus.tcpstore import StoreTransport, parse_members
from fastft.errors import RelayUnreachable
from fastft.protocol import Heartbeat, JobKeys, Role
from fastft.protocol.auth import JobSecret
from fastft.testing import wait_for

JOB = "relay-test"


class Node:
    """One simulated node: an agent endpoint with a hub, and ``make_worker`` for its
    workers; ``direct`` makes a subscriber outside the relay (another node's agent, the
    operator's CLI)."""

    def __init__(self, kind: str, **kw: object) -> None:
        self.kind = kind
        self.kw = kw
        self.endpoints: list[BusEndpoint] = []
        if kind == "memory":
            self.hub_mem = MemoryHub()
        else:
            self.store = host_store()
        self.hub = RelayHub(
            max_queue=int(kw.get("max_queue", 1024)), stale_s=float(kw.get("stale_s", 2.0))
        )  # type: ignore[arg-type]
        agent = BusConfig(job=JOB, rank=-1, incarnation=7, role=Role.AGENT, **kw)  # type: ignore[arg-type]
        self.agent = self._endpoint(agent, hub=self.hub)

    def _endpoint(
        self, cfg: BusConfig, relay: str | None = None, hub: RelayHub | None = None
    ) -> BusEndpoint:
        if self.kind == "memory":
            inner = MemoryTransport(self.hub_mem, cfg)
            if relay is not None:
                t: object = RelayedTransport(inner, relay, cfg.idle_pop_s)
            elif hub is not None:
                t = HubTransport(inner, hub, cfg.idle_pop_s)
            else:
                t = inner
            ep = BusEndpoint(cfg, t)  # type: ignore[arg-type]
        else:
            ep = open_bus(self.store, cfg, relay=relay, hub=hub)
        self.endpoints.append(ep)
        return ep.start()

    def worker(self, rank: int, **kw: object) -> BusEndpoint:
        cfg = BusConfig(job=JOB, rank=rank, incarnation=rank + 100, **{**self.kw, **kw})  # type: ignore[arg-type]
        return self._endpoint(cfg, relay=self.hub.address)

    def direct(self, rank: int, **kw: object) -> BusEndpoint:
        cfg = BusConfig(job=JOB, rank=rank, incarnation=rank + 100, **{**self.kw, **kw})  # type: ignore[arg-type]
        return self._endpoint(cfg)

    def close(self) -> None:
        for ep in reversed(self.endpoints):
            ep.close()


@pytest.fixture(params=["memory", "tcpstore"])
def node(request):
    made: list[Node] = []

    def make(**kw: object) -> Node:
        made.append(Node(request.param, **kw))
        return made[-1]

    yield make
    for n in made:
        n.close()


def hb(rank: int, step: int) -> Heartbeat:
    return Heartbeat(job=JOB, epoch=0, rank=rank, incarnation=rank + 100, step=step)


def steps(ep: BusEndpoint, wait_s: float = 0.05) -> list[tuple[int, int]]:
    out = []
    while (m := ep.recv(wait_s)) is not None:
        out.append((m.rank, m.step))
    return out


def test_every_broadcast_reaches_every_other_process_once_and_never_its_sender(node):
    n = node()
    w = [n.worker(r) for r in range(3)]
    other = n.direct(9)  # another node's agent, or the operator's CLI
    w[0].broadcast(hb(0, 1))
    n.agent.broadcast(hb(-1, 2))
    other.broadcast(hb(9, 3))
    assert wait_for(lambda: n.hub.stats.frames >= 3, 5.0)
    time.sleep(0.1)  # (nothing more may arrive: the sender's echo is dropped)
    # (FIFO holds per publisher only: the three publishers' frames may interleave)
    assert sorted(steps(w[0])) == [(-1, 2), (9, 3)]
    assert sorted(steps(w[1])) == sorted(steps(w[2])) == [(-1, 2), (0, 1), (9, 3)]
    assert sorted(steps(n.agent)) == [(0, 1), (9, 3)]
    assert sorted(steps(other)) == [(-1, 2), (0, 1)]
    assert n.hub.stats.clients == 3


def test_the_store_has_one_subscriber_per_node_and_a_broadcast_one_push_per_node():
    n = Node("tcpstore")
    try:
        workers = [n.worker(r) for r in range(8)]
        members = parse_members(n.store.get(JobKeys(JOB).bus_members))
        assert list(members.values()) == [
            f"-1.7.{int(Role.AGENT)}"
        ]  # the agent alone, not its 8 workers
        # a worker's publisher pushes to the store's subscribers: the one agent
        assert StoreTransport(n.store, workers[3].config).push_all(b"x") == 1
    finally:
        n.close()


def test_fifo_per_publisher_through_the_relay_with_two_concurrent_publishers(node):
    n = node()
    sub = n.worker(5)
    pubs = [n.worker(0, subscribe=False), n.direct(1, subscribe=False)]
    count = 300

    def publish(p: BusEndpoint, r: int) -> None:
        for i in range(count):
            p.broadcast(hb(r, i))

    threads = [threading.Thread(target=publish, args=(p, r)) for r, p in enumerate(pubs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(2 * count):
        m = sub.recv(5.0)
        assert m is not None
        got[m.rank].append(m.step)
    assert got[0] == list(range(count)) and got[1] == list(range(count))


def test_a_worker_that_stops_reading_is_cut_off_and_joins_again(node):
    n = node(max_queue=64, idle_pop_s=0.2, stale_s=0.3)
    gate = threading.Event()
    slow = n.worker(1)
    slow.subscribe(lambda m: gate.wait(20))  # stops reading after the first frame
    fast = n.worker(2)
    pub = n.direct(0, subscribe=False)
    i = 0
    deadline = time.monotonic() + 20
    while n.hub.stats.cut_off == 0 and time.monotonic() < deadline:
        pub.broadcast(hb(0, i))
        m = fast.recv(5.0)  # the reading worker gets everything, in order
        assert m is not None and m.step == i
        i += 1
        time.sleep(0.001)
    assert n.hub.stats.cut_off == 1 and fast.stats.self_evictions == 0
    gate.set()
    assert wait_for(lambda: slow.stats.self_evictions == 1, 10.0)
    pub.broadcast(hb(0, 99999))
    assert wait_for(lambda: any(s == 99999 for _, s in steps(slow, 0.01)), 5.0)


def test_sealed_frames_are_checked_by_each_worker_not_the_relay(node):
    secret = JobSecret.draw()
    n = node(secret=secret)
    w = n.worker(1)
    forger = n.direct(0, subscribe=False, secret=None)
    forger.broadcast(hb(0, 1))  # no tag: relayed as it is, dropped by the worker
    good = n.direct(2, subscribe=False)
    good.broadcast(hb(2, 2))
    m = w.recv(5.0)
    assert m is not None and (m.rank, m.step) == (2, 2)
    # (the agent's own endpoint reads the same frames on its own thread: it may be behind)
    assert w.stats.forged == 1 and wait_for(lambda: n.agent.stats.forged == 1, 5.0)


def test_when_the_agent_goes_the_worker_keeps_trying_and_still_closes_at_once(node):
    n = node(idle_pop_s=0.2)
    w = n.worker(1)
    n.agent.close()
    assert wait_for(lambda: w.stats.transport_errors >= 1, 5.0)
    t = time.perf_counter()
    w.close()
    assert time.perf_counter() - t < 0.5


def test_a_worker_without_its_agent_fails_with_the_reason():
    hub = RelayHub()  # never started: nothing listens at its address
    cfg = BusConfig(job=JOB, rank=1, incarnation=1)
    t = RelayedTransport(MemoryTransport(MemoryHub(), cfg), hub.address, cfg.idle_pop_s)
    with pytest.raises(RelayUnreachable, match="agent"):
        t.join("1.1.0")
    t.close()
    hub.close()


def test_a_client_that_sends_no_label_is_refused_and_gets_nothing():
    with RelayHub() as hub:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)
        s.connect(sockaddr(hub.address))
        s.sendall(b"x" * HELLO_MAX)  # no newline within the limit
        assert s.recv(16) == b""  # closed by the hub, nothing sent
        s.close()
        assert hub.stats.refused == 1 and hub.stats.clients == 0
