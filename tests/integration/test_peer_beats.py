"""Node leases as beats from agent to agent on the TCPStore plane (issue 64,
``--node-beats peers``): agents' leases against a real TCPStore in one process. The store
sees no renewal; a node that stops is declared within a lease by one watcher, through the
store's compare-and-set; the node itself hears a declaration at once; a node done is not
declared; a forged or oversized frame moves nothing; a node's new agent (a new port) is
heard again."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from fastft.bus import host_store
from fastft.bus.signed import SignedStore
from fastft.launch.nodes.peerbeats import PEERS_ABOVE, PeerBeats, PeerLease, peer_beats
from fastft.launch.rules.leasewatch import LeaseConfig
from fastft.launch.rules.lives import format_lives
from fastft.protocol.auth import JobSecret, ValueAuth
from fastft.protocol.keys import JobKeys

pytestmark = pytest.mark.timeout(60)

AUTH = ValueAuth(JobSecret.draw())
CFG = LeaseConfig(heartbeat_ms=100, misses=3)


class _Agent:
    def __init__(self, store, keys: JobKeys, node: int, nnodes: int) -> None:
        self.store = SignedStore(store, keys, AUTH)
        self.store.set(keys.node_lives(node), format_lives({node: 10 + node}))
        self.beats = PeerBeats(
            self.store, keys, node, AUTH.sign, AUTH.verify, toward="127.0.0.1:1",
            timeout_s=CFG.lease_s,
        )  # fmt: skip
        self.lost: list[tuple[int, dict[int, int]]] = []
        self.fenced: list[str] = []
        self.store_lost: list[str] = []
        self.lease = PeerLease(
            self.store, keys, node, nnodes, CFG,
            on_lost=lambda n, lives, c: self.lost.append((n, lives)),
            on_fenced=self.fenced.append,
            on_store_lost=lambda why, silent: self.store_lost.append(why),
            beats=self.beats,
        ).start()  # fmt: skip


@pytest.fixture
def job():
    store = host_store()
    agents: list[_Agent] = []
    yield store, agents
    for a in agents:
        a.lease.close()
    del store


def _start(job, name: str, nodes: list[int], nnodes: int) -> tuple[JobKeys, list[_Agent]]:
    store, agents = job
    keys = JobKeys(name)
    got = [_Agent(store, keys, n, nnodes) for n in nodes]
    agents += got
    return keys, got


def test_auto_beats_from_agent_to_agent_above_256_nodes():
    assert not peer_beats("auto", PEERS_ABOVE) and peer_beats("auto", PEERS_ABOVE + 1)
    assert peer_beats("peers", 2) and not peer_beats("store", 4096)


def test_a_node_that_stops_is_declared_once_through_the_store_which_saw_no_renewal(job):
    keys, (a, b, c) = _start(job, "peers1", [0, 1, 2], 3)
    time.sleep(1.0)
    assert [x.lost for x in (a, b, c)] == [[], [], []]
    assert all(
        x.beats.counters([n])[n] >= 5 for x in (a, b, c) for n in range(3) if n != x.beats.node
    )
    for n in range(3):  # (the store's counters were made at the start and never renewed)
        assert int(a.store.get(keys.node_lease(n)) or b"0") == 0
    stopped = time.monotonic()
    c.lease.close()  # (a node lost whole: its beats stop, it says nothing)
    while not (a.lost or b.lost) and time.monotonic() < stopped + 5.0:
        time.sleep(0.01)
    took = time.monotonic() - stopped
    time.sleep(0.5)
    assert a.lost + b.lost == [(2, {2: 12})], (a.lost, b.lost)  # (one watcher won)
    assert took < 0.3 + 0.1 + 0.25, f"declared after {took:.2f} s"  # lease + a round
    assert a.store.get(keys.node_lost(2)).decode().endswith("/2:12")
    assert a.store_lost == [] and b.store_lost == [] and a.fenced == b.fenced == []


def test_the_node_hears_its_declaration_at_once_and_a_node_done_is_not_declared(job):
    # (5,000 nodes: each agent reads the store's marks every 5 s)
    keys, (a, b, c) = _start(job, "peers2", [0, 1, 2], 5000)
    time.sleep(0.8)
    mark = f"{a.beats.counters([1])[1]}@0/1:11"
    a.beats.declare(1, mark)  # (up its connection to node 1, as a declaring watcher does)
    deadline = time.monotonic() + 3.0
    while not b.fenced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.fenced == [mark]
    b.lease.say_done()  # (its watcher, node 0, is told before its beats stop)
    b.lease.close()
    time.sleep(1.0)
    assert a.lost == [] and c.lost == []


def test_a_watcher_holds_three_connections_and_each_beat_goes_on_one(job):
    # (issue 60, case 6: a beat lost in a flap waits for TCP's retransmission, and every
    # beat behind it on the same connection; the next goes on one with nothing in flight)
    _, (a, b) = _start(job, "peers7", [0, 1], 2)
    time.sleep(1.0)
    with b.beats._lock:
        conns = list(b.beats._watchers)
    assert len(conns) == 3 and {c.watcher for c in conns} == {0}
    frames = [0]
    heard = a.beats._heard_msg

    def counted(subject: str, raw: bytes) -> None:
        frames[0] += 1
        heard(subject, raw)

    a.beats._heard_msg = counted  # type: ignore[method-assign]
    before = a.beats.counters([1])[1]
    time.sleep(1.0)
    beats = a.beats.counters([1])[1] - before
    assert beats >= 7 and frames[0] <= beats + 1, (beats, frames)  # (not 3 copies each)


def test_a_forged_or_oversized_frame_moves_nothing(job):
    keys, (a, b) = _start(job, "peers3", [0, 1], 2)
    time.sleep(0.6)
    host, _, port = b.beats.address.rpartition(":")
    other = ValueAuth(JobSecret.draw())
    subject = f"fastft.{keys.job}.beat.1"
    with socket.create_connection((host, int(port)), timeout=2.0) as s:
        forged = other.sign(subject, "1 0 - 99@0/1:11").encode()  # (another job's secret)
        s.sendall(struct.pack(">I", len(forged)) + forged)
        s.sendall(struct.pack(">I", 1 << 20))  # (no beat is 1 MB)
        time.sleep(0.5)
    assert b.beats.forged >= 2 and b.fenced == [] and b.beats.declared(1) == ""
    assert a.lost == [] and b.lost == []


def test_a_nodes_new_agent_is_heard_on_its_new_port(job):
    keys, (a, b) = _start(job, "peers4", [0, 1], 2)
    time.sleep(0.6)
    old = b.beats.address
    b.lease.close()
    (b2,) = _start(job, "peers4", [1], 2)[1]
    assert b2.beats.address != old
    heard = a.beats.counters([1])[1]
    deadline = time.monotonic() + 5.0
    while a.beats.counters([1])[1] <= heard and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.beats.counters([1])[1] > heard  # (its counter starts again from 1: a new high)


def test_a_node_newly_watched_that_never_started_costs_no_store(job):
    """Node 2 stops and is declared; nodes 0 and 1 then watch past it, up to node 4, which
    never started: its mark is made (a TCPStore read of a missing key waits for it, and a
    marks read that failed once was taken for the store lost)."""
    keys, (a, b, c, d) = _start(job, "peers6", [0, 1, 2, 3], 5)
    time.sleep(0.6)
    job[0].delete_key(keys.node_lost(4))  # (as if no agent had ever watched node 4)
    c.lease.close()
    deadline = time.monotonic() + 5.0
    while not (a.lost or b.lost) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.5)  # (the marks read again: the ring now reaches node 4)
    assert a.lost + b.lost == [(2, {2: 12})]
    assert 4 in a.lease.marks and a.store.get(keys.node_lost(4)) == b""
    assert [x.store_lost for x in (a, b, d)] == [[], [], []]


def test_threads_end_with_the_leases(job):
    _, (a, b) = _start(job, "peers5", [0, 1], 2)
    time.sleep(0.3)
    a.lease.close(), b.lease.close()
    deadline = time.monotonic() + 5.0
    names = ("fastft-lease", "fastft-peer", "fastft-renew")
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name.startswith(names)]:
            return
        time.sleep(0.05)
    raise AssertionError([t.name for t in threading.enumerate()])
