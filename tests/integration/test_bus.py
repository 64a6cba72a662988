"""The error bus contract, run against both backends (memory and a real TCPStore)."""

from __future__ import annotations

import threading
import time

import pytest

from fastft.bus import BusConfig, MemoryHub, host_store, memory_bus, tcpstore_bus
from fastft.bus.storeclient import StoreClient
from fastft.bus.tcpstore import parse_members
from fastft.errors import BusClosed, ConfigError, ProtocolError
from fastft.protocol import Fault, Heartbeat, JobKeys, Severity, encode
from fastft.testing import wait_for

JOB = "bus-test"


@pytest.fixture(params=["memory", "tcpstore", "tcpstore-torch-free"])
def make(request):
    """make(rank, **config) -> a started endpoint; all share one backend. The torch-free
    variant runs the same contract over the pure-Python client (the operator's CLI)."""
    endpoints = []
    if request.param == "memory":
        hub = MemoryHub()
        factory = lambda cfg: memory_bus(hub, cfg)  # noqa: E731
        backend = hub
    else:
        store = host_store()
        client = StoreClient("127.0.0.1", store.port) if request.param != "tcpstore" else store
        factory = lambda cfg: tcpstore_bus(client, cfg)  # noqa: E731
        backend = store

    def _make(rank, **kw):
        ep = factory(BusConfig(job=JOB, rank=rank, incarnation=rank + 100, **kw)).start()
        endpoints.append(ep)
        return ep

    _make.backend = backend
    _make.kind = request.param
    yield _make
    for ep in endpoints:
        ep.close()


def hb(rank, step, job=JOB):
    return Heartbeat(job=job, epoch=0, rank=rank, incarnation=rank + 100, step=step)


def test_broadcast_reaches_every_other_subscriber_not_the_sender(make):
    a, b, c = make(0), make(1), make(2)
    sent = a.broadcast(hb(0, 5))
    assert sent.seq == 1 and sent.wall_time > 0
    assert b.recv(2.0) == sent and c.recv(2.0) == sent
    assert a.recv(0.05) is None


def test_fifo_per_publisher_with_two_concurrent_publishers(make):
    sub = make(9)
    pubs = [make(r, subscribe=False) for r in (0, 1)]
    n = 300

    def publish(p, r):
        for i in range(n):
            p.broadcast(hb(r, i))

    threads = [threading.Thread(target=publish, args=(p, r)) for r, p in enumerate(pubs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got = {0: [], 1: []}
    for _ in range(2 * n):
        m = sub.recv(5.0)
        assert m is not None
        got[m.rank].append((m.step, m.seq))
    assert [s for s, _ in got[0]] == list(range(n))
    assert [s for s, _ in got[1]] == list(range(n))
    assert [q for _, q in got[0]] == list(range(1, n + 1))


def test_callbacks_run_in_the_listener_and_errors_do_not_stop_it(make):
    sub = make(1)
    seen = []
    sub.subscribe(lambda m: (_ for _ in ()).throw(RuntimeError("bad callback")))
    sub.subscribe(lambda m: seen.append((m.step, threading.current_thread().name)))
    pub = make(0, subscribe=False)
    for i in range(3):
        pub.broadcast(hb(0, i))
    assert wait_for(lambda: len(seen) == 3, 5.0)
    assert [s for s, _ in seen] == [0, 1, 2]
    assert all(name.startswith("fastft-bus-") for _, name in seen)
    assert sub.stats.callback_errors == 3


@pytest.mark.parametrize(
    "raw",
    [b"", b"garbage", b"FT\x02" + b"\x00" * 60, b"\x00" * 47, encode(hb(0, 1, job="other-job"))],
    ids=["empty", "garbage", "bad-version", "zeros", "foreign-job"],
)
def test_malformed_messages_are_counted_never_delivered_never_fatal(make, raw):
    sub = make(1)
    pub = make(0, subscribe=False)
    pub.publish_raw(raw)
    pub.broadcast(hb(0, 7))
    m = sub.recv(5.0)
    assert m is not None and m.step == 7  # the good one still arrives, after the bad one
    assert sub.stats.malformed == 1 and sub.stats.delivered == 1
    assert sub.stats.malformed_samples


def test_broadcast_of_foreign_job_is_refused(make):
    pub = make(0, subscribe=False)
    with pytest.raises(ProtocolError):
        pub.broadcast(hb(0, 1, job="other"))


def test_close_is_fast_and_idempotent(make):
    eps = [make(r) for r in range(4)]
    t = time.perf_counter()
    for ep in eps:
        ep.close()
    per_close = (time.perf_counter() - t) / len(eps)
    assert per_close < 0.1, f"close took {per_close * 1e3:.1f} ms"
    eps[0].close()
    with pytest.raises(BusClosed):
        eps[0].broadcast(hb(0, 1))
    with pytest.raises(BusClosed):
        eps[0].recv(0.01)


def test_close_while_a_recv_waits_releases_it(make):
    sub = make(1)
    out = []
    t = threading.Thread(target=lambda: out.append(_recv_or_closed(sub)))
    t.start()
    time.sleep(0.05)
    sub.close()
    t.join(1.0)
    assert out == ["closed"]


def _recv_or_closed(ep):
    try:
        return ep.recv(10.0)
    except BusClosed:
        return "closed"


def test_a_subscriber_that_stops_reading_is_evicted_and_memory_stays_bounded(make):
    gate = threading.Event()
    slow = make(1, max_queue=64, idle_pop_s=0.2, stale_s=0.3)
    slow.subscribe(lambda m: gate.wait(10))  # stops reading after the first message
    fast = make(2)
    pub = make(0, subscribe=False, max_queue=64, stale_s=0.3)
    i = 0
    deadline = time.monotonic() + 10
    # evicted once its queue is full and it has not read for stale_s
    while pub.stats.evicted_peers == 0 and time.monotonic() < deadline:
        pub.broadcast(hb(0, i))
        m = fast.recv(5.0)  # the reading subscriber gets everything, in order
        assert m is not None and m.step == i
        i += 1
        time.sleep(0.001)  # a steady stream, so that stale_s passes before the hard cap
    assert pub.stats.evicted_peers == 1 and fast.stats.self_evictions == 0
    assert i < 16 * 64, "evicted for not reading, not by the hard cap"
    if make.kind.startswith("tcpstore"):
        keys = JobKeys(JOB)
        assert wait_for(
            lambda: make.backend.queue_len(keys.bus_queue(slow.subscriber_id)) == 0, 5.0
        )
    else:
        assert slow.subscriber_id not in make.backend.queues
    gate.set()
    # the evicted subscriber notices, says so, and re-joins
    assert wait_for(lambda: slow.stats.self_evictions == 1, 5.0)
    pub.broadcast(hb(0, 999))
    assert wait_for(lambda: any(m.step == 999 for m in _drain(slow)), 5.0)


def _drain(ep):
    out = []
    while (m := ep.recv(0.01)) is not None:
        out.append(m)
    return out


def test_no_key_per_message_over_many_messages(make):
    """Memory stays bounded over a long run: no store key is created per message, every
    queue is emptied by its reader, and the local buffer of an endpoint nobody recv()s from
    drops its oldest messages (counted)."""
    sub = make(1)
    pub = make(0, subscribe=False)
    count = {"n": 0}
    sub.subscribe(lambda m: count.__setitem__("n", count["n"] + 1))
    n = 3000 if make.kind.startswith("tcpstore") else 20000
    keys_before = make.backend.num_keys() if make.kind.startswith("tcpstore") else None
    for i in range(n):
        pub.broadcast(hb(0, i))
        if i % 256 == 255:  # a bus carries bursts, not a firehose: let the reader keep up
            assert wait_for(lambda i=i: count["n"] == i + 1, 10.0)
    assert wait_for(lambda: count["n"] == n, 20.0)
    assert sub.stats.self_evictions == 0
    if make.kind.startswith("tcpstore"):
        assert make.backend.num_keys() == keys_before
        assert make.backend.queue_len(JobKeys(JOB).bus_queue(sub.subscriber_id)) == 0
    else:
        assert all(len(q) <= 1 for q in make.backend.queues.values())  # a wake sentinel at most
    assert sub.stats.dropped_local == max(0, n - sub.config.local_buffer)


def test_leave_removes_the_subscriber(make):
    a, b = make(0), make(1)
    gone = b.subscriber_id
    b.close()
    if make.kind.startswith("tcpstore"):
        members = parse_members(make.backend.get(JobKeys(JOB).bus_members))
    else:
        members = make.backend.queues
    assert gone not in members and a.subscriber_id in members
    a.broadcast(hb(0, 1))  # nobody left to deliver to: still fine


def test_fault_message_round_trip(make):
    a, b = make(0), make(1)
    f = Fault(
        job=JOB,
        epoch=3,
        rank=0,
        incarnation=100,
        step=12,
        severity=Severity.FAULT1,
        cause="ECC error",
        faulty_rank=0,
        detail="GPU 3",
    )
    a.broadcast(f)
    got = b.recv(5.0)
    assert isinstance(got, Fault) and got.cause == "ECC error" and got.step == 12


@pytest.mark.parametrize(
    "kw", [{"job": ""}, {"job": "a/b"}, {"max_queue": 1}, {"idle_pop_s": 0}, {"local_buffer": 0}]
)
def test_bad_config_fails_at_start(kw):
    base = dict(job=JOB, rank=0, incarnation=1)
    base.update(kw)
    with pytest.raises(ConfigError):
        BusConfig(**base)


EVICT_THEN_EXIT = r"""
import sys, threading, time
from fastft.bus import BusConfig, host_store, tcpstore_bus
from fastft.protocol import Heartbeat
store = host_store()
cfg = lambda r, **kw: BusConfig(job="j", rank=r, incarnation=r + 100, **kw)
gate = threading.Event()
slow = tcpstore_bus(store, cfg(1, max_queue=64, idle_pop_s=0.2, stale_s=0.3)).start()
slow.subscribe(lambda m: gate.wait(60))  # a subscriber that never reads again
pub = tcpstore_bus(store, cfg(0, subscribe=False, max_queue=64, stale_s=0.3)).start()
i, deadline = 0, time.monotonic() + 20
while pub.stats.evicted_peers == 0 and time.monotonic() < deadline:
    pub.broadcast(Heartbeat(job="j", epoch=0, rank=0, incarnation=100, step=i))
    i += 1
    time.sleep(0.001)
assert pub.stats.evicted_peers == 1
if sys.argv[1] == "close":
    pub.close()
sys.exit(0)  # at once: the evicted queue's drain is still running in a thread
"""


@pytest.mark.parametrize("how", ["exit", "close"])
def test_exiting_right_after_an_eviction_ends_with_status_0(tmp_path, how):
    """An eviction drains the queue on a thread inside a torch store call; a process that
    exited during the drain aborted ("terminate called without an active exception",
    SIGABRT: the agent's own exit status, issue 25), 8 runs in 8."""
    import subprocess
    import sys

    script = tmp_path / "evict.py"
    script.write_text(EVICT_THEN_EXIT)
    for _ in range(3):
        p = subprocess.run(
            [sys.executable, str(script), how], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert "terminate called" not in p.stderr
