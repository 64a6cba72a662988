"""Node leases as core-NATS beats (issue 60, case 5): the message format (pure), and two
agents' leases on a real 3-server cluster: a node that stops is declared within a lease
(not 3 s), a node that says it is done is not, a forged beat moves nothing, and a server
killed (the key-value stream's leader, when it is) costs no node."""

from __future__ import annotations

import threading
import time

import pytest

from fastft.bus.nats import shutdown
from fastft.bus.natscluster import LocalCluster
from fastft.bus.natsio import pinned, run
from fastft.bus.natsstore import connect_nats
from fastft.bus.signed import SignedStore
from fastft.launch.nodes.beatlease import BeatLease, marks_every
from fastft.launch.nodes.beats import Beat, Beats, beat_subject, decode, encode
from fastft.launch.rules.leasewatch import LeaseConfig
from fastft.protocol.auth import JobSecret, ValueAuth
from fastft.protocol.keys import JobKeys

pytestmark = pytest.mark.timeout(90)

AUTH = ValueAuth(JobSecret.draw())
CFG = LeaseConfig(heartbeat_ms=100, misses=3, store_grace_s=15.0)


def test_a_beat_round_trips_and_a_forged_or_malformed_one_is_none():
    s = beat_subject("job.1 x", 3)
    assert s == "fastft.job=2E1=20x.beat.3"  # (one token: no dot or space of the job's)
    b = Beat(3, 41, {6: 9, 7: 12})
    assert decode(encode(b, AUTH.sign, s), AUTH.verify, s) == b
    lost = Beat(3, 0, lost="40@1/6:9,7:12")
    assert decode(encode(lost, AUTH.sign, s), AUTH.verify, s) == lost
    other = ValueAuth(JobSecret.draw())
    assert decode(encode(b, other.sign, s), AUTH.verify, s) is None  # another job's secret
    assert decode(encode(b, AUTH.sign, s), AUTH.verify, beat_subject("job.1 x", 4)) is None
    assert decode(AUTH.sign(s, "3 x - -").encode(), AUTH.verify, s) is None  # malformed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("nats"), servers=3) as c:
        yield c
    shutdown()


class _Agent:
    """One node's lease on the cluster, with what it was told."""

    def __init__(
        self, cluster: LocalCluster, job: str, node: int, lives: dict[int, int], nnodes: int = 2
    ):
        self.keys = JobKeys(job)
        self.store = SignedStore(connect_nats(cluster.address, 10.0), self.keys, AUTH)
        servers = cluster.address.split(",")
        self.beats = Beats(
            pinned(servers, 3, 10.0), job, node, AUTH.sign, AUTH.verify, timeout_s=CFG.lease_s
        )
        self.lost: list[tuple[int, dict[int, int], float]] = []
        self.fenced: list[str] = []
        self.store_lost: list[str] = []
        self.lease = BeatLease(
            self.store, self.keys, node, nnodes, CFG,
            on_lost=lambda n, lives, c: self.lost.append((n, lives, time.monotonic())),
            on_fenced=self.fenced.append,
            on_store_lost=lambda why, silent: self.store_lost.append(why),
            beats=self.beats,
        )  # fmt: skip
        self.lease.set_lives(lives)

    def start(self) -> _Agent:
        self.lease.start()
        return self


def _pair(cluster, job):
    a, b = _Agent(cluster, job, 0, {0: 5}), _Agent(cluster, job, 1, {1: 7})
    a.start(), b.start()
    time.sleep(1.0)
    assert a.lost == [] and b.lost == []
    return a, b


def test_a_stopped_node_is_declared_within_a_lease_and_its_mark_written(cluster):
    a, b = _pair(cluster, "beats1")
    try:
        stopped = time.monotonic()
        b.lease.stop()  # (its beats stop; it said nothing: a node lost whole)
        deadline = stopped + 5.0
        while not a.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(n, lives) for n, lives, _ in a.lost] == [(1, {1: 7})]
        took = a.lost[0][2] - stopped
        assert took < 0.3 + 0.1 + 0.25, f"declared after {took:.2f} s"  # lease + a round
        mark = ""
        while not mark and time.monotonic() < deadline:
            mark = a.store.get(a.keys.node_lost(1)).decode()
            time.sleep(0.05)
        assert mark.startswith(f"{a.lost and a.lease.watch.counter(1)}@0/") and "1:7" in mark
        assert a.store_lost == [] and a.fenced == []
    finally:
        a.lease.close(), b.lease.close()


def test_a_node_done_is_not_declared_and_a_forged_beat_moves_nothing(cluster):
    a, b = _pair(cluster, "beats2")
    try:
        before = a.beats.counters([1])[1]
        forged = Beat(1, before + 10_000, {1: 8})
        other = ValueAuth(JobSecret.draw())
        subject = beat_subject("beats2", 1)

        async def send() -> None:
            nc = b.beats.conns[0]
            await nc.publish(subject, encode(forged, other.sign, subject))
            await nc.publish(subject, b"junk")
            await nc.flush()

        run(send(), 5.0)
        time.sleep(0.3)
        assert a.beats.forged >= 2 and a.beats.counters([1])[1] < before + 10_000
        b.lease.say_done()
        b.lease.stop()
        time.sleep(1.5)
        assert a.lost == []
    finally:
        a.lease.close(), b.lease.close()


def test_a_server_killed_costs_no_node(tmp_path):
    """The key-value stream's leader killed (or another server: the beats go through every
    one): no node is declared, although the bucket stalls for its election."""
    with LocalCluster(tmp_path / "nats", servers=3) as cluster:
        a, b = _pair(cluster, "beats3")
        try:
            leader = cluster.leader(wait_s=10)
            cluster.kill(leader if leader is not None else 0)
            time.sleep(4.0)
            assert a.lost == [] and b.lost == [], (a.lost, b.lost)
            assert a.store_lost == [] and b.store_lost == []
        finally:
            a.lease.close(), b.lease.close()


def test_a_declaration_heard_fences_the_node_before_the_bucket_is_read(cluster):
    """At 5,000 nodes an agent reads the bucket's marks every 5 s (the job's agents 1,000
    reads a second in all, not 50,000); a declaration of its node travels with the beats,
    and it fences at once."""
    assert marks_every(0.1, 64) == 0.1 and marks_every(0.1, 5000) == 5.0
    a = _Agent(cluster, "beats5", 0, {0: 5}, nnodes=5000).start()
    b = _Agent(cluster, "beats5", 1, {1: 7}, nnodes=5000).start()
    try:
        time.sleep(0.5)
        mark = f"{a.beats.counters([1])[1]}@0/1:7"
        a.beats.declare(1, mark)  # (as a watcher that found its lease expired)
        told = time.monotonic()
        while not b.fenced and time.monotonic() < told + 3.0:
            time.sleep(0.01)
        assert b.fenced == [mark], "fenced only once the bucket was read"
        assert a.lost == [] and b.store_lost == []
    finally:
        a.lease.close(), b.lease.close()


def test_threads_end_with_the_leases(cluster):
    a, b = _pair(cluster, "beats4")
    a.lease.close(), b.lease.close()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name.startswith("fastft-lease")]:
            return
        time.sleep(0.05)
    raise AssertionError([t.name for t in threading.enumerate()])
