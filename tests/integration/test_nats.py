"""The NATS control plane against real servers on 127.0.0.1 (ports the OS picked): the
store keeps TCPStore's semantics (the runtime, the agents and Gloo's rendezvous use it
unchanged), the bus keeps the bus contract, and bad input fails at start in one line."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fastft.bus import BusConfig, connect_store, open_bus
from fastft.bus.nats import shutdown
from fastft.bus.natscluster import LocalCluster, server_binary
from fastft.bus.natsstore import NatsStore, connect_nats
from fastft.errors import StoreUnreachable
from fastft.protocol import Fault, Role, Severity

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("nats"), servers=1) as c:
        yield c
    shutdown()


@pytest.fixture
def store(server) -> NatsStore:
    s = connect_nats(server.address, timeout_s=5.0)
    assert isinstance(connect_store(server.address), NatsStore)  # the one entry point
    return s


def test_the_store_keeps_tcpstores_semantics(store, request):
    p = request.node.name + "/"
    store.set(p + "a", b"x")
    assert store.get(p + "a") == b"x"
    assert store.add(p + "n", 2) == 2 and store.add(p + "n", 3) == 5
    assert store.compare_set(p + "c", "", "v1") == b"v1"  # a missing key counts as empty
    assert store.compare_set(p + "c", "no", "v2") == b"v1"  # the value that holds
    assert store.compare_set(p + "c", "v1", "v2") == b"v2"
    assert store.compare_set(p + "missing", "x", "y") == b"x"  # TCPStore returns expected
    assert store.check([p + "a", p + "c"]) and not store.check([p + "zz"])
    assert store.multi_get([p + "a", p + "n"]) == [b"x", b"5"]
    assert store.delete_key(p + "a") and not store.check([p + "a"])
    assert store.compare_set(p + "a", "", "again") == b"again"  # a deleted key is new again
    odd = p + "fastft/job.1:x y/é"  # escaped into the characters JetStream allows
    store.set(odd, "1")
    assert store.get(odd) == b"1" and not store.check([p + "fastft/job=2E1:x y/é"])


def test_many_keys_read_at_once_with_none_for_the_missing(store, request):
    """A formation reads every arrival in one round trip on NATS (its add is a
    compare-and-set loop); a missing key is None at once, not waited for; through the
    signed store a forged value is None too, and counted."""
    from fastft.bus.signed import SignedStore
    from fastft.protocol.auth import JobSecret, ValueAuth
    from fastft.protocol.keys import JobKeys

    p = request.node.name + "/"
    store.set(p + "a", "x")
    t0 = time.monotonic()
    assert store.read_many([p + "a", p + "none", p + "a"]) == [b"x", None, b"x"]
    assert time.monotonic() - t0 < 1.0  # (the store's timeout is 30 s)
    keys = JobKeys(p.strip("/"))
    signed = SignedStore(store, keys, ValueAuth(JobSecret.draw()))
    arrival = keys.epoch_arrival(2, 0)
    signed.set(arrival, "signed")
    store.set(keys.epoch_arrival(2, 1), "forged")  # (no tag)
    got = signed.read_many([arrival, keys.epoch_arrival(2, 1), keys.epoch_arrival(2, 2)])
    assert got == [b"signed", None, None] and signed.forged.total == 1


def test_a_watch_is_pushed_the_keys_under_its_prefix_then_and_since(store, request):
    """The closer of a formation watches the epoch's arrivals on NATS, and reads the
    joiners so (fastft.bus.natswatch: pushed, not read key by key); through the signed
    store a forged value is left out and counted; the keys' escape reads back."""
    from fastft.bus.nats import escape_key
    from fastft.bus.natswatch import unescape_key
    from fastft.bus.signed import SignedStore
    from fastft.protocol.auth import JobSecret, ValueAuth
    from fastft.protocol.keys import JobKeys

    keys = JobKeys(request.node.name[:40])
    signed = SignedStore(store, keys, ValueAuth(JobSecret.draw()))
    prefix = keys.epoch_arrived(3)
    signed.multi_set([keys.epoch_arrival(3, 0), keys.epoch_arrival(3, 1)], ["a0", "a1"])
    signed.set(keys.epoch_arrival(4, 0), "another epoch")
    assert signed.read_prefix(prefix) == {
        keys.epoch_arrival(3, 0): b"a0",
        keys.epoch_arrival(3, 1): b"a1",
    }
    w = signed.watch(prefix)
    try:
        signed.set(keys.epoch_arrival(3, 12), "a12")
        store.set(keys.epoch_arrival(3, 13), "forged")  # (no tag)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # (both pushed: the forged one read, and left out)
            got = w.values()
            if keys.epoch_arrival(3, 12) in got and signed.forged.total:
                break
            time.sleep(0.01)
        assert got[keys.epoch_arrival(3, 12)] == b"a12" and len(got) == 3, got
        assert signed.forged.total == 1
    finally:
        w.close()
    assert store.read_prefix(keys.epoch_arrived(9)) == {}  # (nothing there: at once)
    for k in ("fastft/j/pg/3//0", "/a/", "a.b=c/d", "x y/é"):
        assert unescape_key(escape_key(k)) == k


def test_a_missing_key_is_waited_for_until_the_timeout(store, request):
    key = request.node.name
    short = store.clone()
    short.set_timeout(datetime.timedelta(seconds=0.3))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        short.get(key)
    assert 0.25 < time.monotonic() - t0 < 3
    threading.Timer(0.2, lambda: store.set(key, "late")).start()
    assert store.get(key) == b"late"


def test_concurrent_adds_are_counted_once_each(store, request):
    key = request.node.name
    clones = [store.clone() for _ in range(4)]
    threads = [
        threading.Thread(target=lambda c=c: [c.add(key, 1) for _ in range(25)]) for c in clones
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.add(key, 0) == 100


def test_gloo_rendezvous_through_the_nats_store(store, request):
    out: dict[int, torch.Tensor] = {}

    def member(rank: int) -> None:
        ps = dist.PrefixStore(request.node.name + "/", store)
        pg = dist.ProcessGroupGloo(ps, rank, 2, datetime.timedelta(seconds=20))
        t = torch.full((3,), float(rank + 1))
        pg.allreduce([t]).wait()
        out[rank] = t

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [out[r].tolist() for r in (0, 1)] == [[3.0] * 3] * 2


def _fault(job: str, rank: int) -> Fault:
    return Fault(
        job=job,
        epoch=1,
        rank=rank,
        incarnation=7,
        role=Role.WORKER,
        severity=Severity.FAULT2,
        cause="test",
        faulty_rank=rank,
        faulty_incarnation=7,
    )


def test_the_bus_delivers_in_order_to_others_and_drops_what_is_not_fastft(store, request):
    job = request.node.name.replace("_", "-")[:40]
    a = open_bus(store, BusConfig(job=job, rank=0, incarnation=1)).start()
    b = open_bus(store.clone(), BusConfig(job=job, rank=1, incarnation=2)).start()
    try:
        for _ in range(20):
            a.broadcast(_fault(job, 0))
        b.publish_raw(b"not a fastft message")
        got = [b.recv(5.0) for _ in range(20)]
        assert all(m is not None for m in got)
        assert [m.seq for m in got if m is not None] == sorted(m.seq for m in got if m)
        assert b.recv(0.3) is None  # nothing else for b: not its own raw bytes either
        deadline = time.monotonic() + 5
        while a.stats.malformed < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.stats.malformed == 1 and a.stats.delivered == 0  # counted, dropped
        assert b.stats.malformed == 0  # its own publish is not echoed to it
    finally:
        a.close()
        b.close()


def test_fastft_inject_over_nats_imports_no_torch_and_reaches_a_subscriber(
    store, server, request, tmp_path
):
    from fastft.protocol import Inject
    from fastft.protocol.auth import JobSecret

    job = request.node.name.replace("_", "-")[:40]
    secret = JobSecret.draw().save(tmp_path / "job.secret")
    cfg = BusConfig(job=job, rank=0, incarnation=1, secret=JobSecret.load(secret))
    sub = open_bus(store, cfg).start()
    code = (
        "import sys\n"
        "from fastft.cli import main\n"
        f"rc = main(['inject', '--store', {server.address!r}, '--job', {job!r}, "
        f"'--job-secret-file', {str(secret)!r}, '--rank', '1', '--kind', 'sigkill'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(rc)\n"
    )
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30)  # fmt: skip
        assert r.returncode == 0, r.stderr
        m = sub.recv(10.0)
        assert isinstance(m, Inject) and m.target_rank == 1
    finally:
        sub.close()


def test_an_unreachable_control_plane_fails_in_one_line(tmp_path):
    with pytest.raises(StoreUnreachable, match="no NATS server answers at nats://127.0.0.1:1"):
        connect_nats("nats://127.0.0.1:1", timeout_s=2.0)
    with pytest.raises(StoreUnreachable, match="use nats://"):
        connect_nats("http://x:1")
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--control", "nats://127.0.0.1:1"),
        *("--run-dir", str(tmp_path / "r"), "-m", "fastft.demo.train"),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "no NATS server answers" in p.stderr


def test_a_server_without_jetstream_fails_in_one_line(tmp_path):
    port = LocalCluster(tmp_path, servers=1).ports[0]
    proc = subprocess.Popen(
        [server_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"nats://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                connect_nats(url, timeout_s=2.0)
                raise AssertionError("connected without JetStream")
            except StoreUnreachable as e:
                if "JetStream" in str(e) or time.monotonic() > deadline:
                    assert "have no JetStream" in str(e) and "-js" in str(e), e
                    break
                time.sleep(0.1)  # not listening yet
    finally:
        proc.terminate()
        proc.wait(10)


def test_fastft_nats_up_prints_the_control_plane_and_stops_cleanly(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-m", "fastft.cli", "nats", "up", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        assert line.count("nats://127.0.0.1:") == 3, line
        s = connect_nats(line, timeout_s=10.0)
        s.set("up", "1")
        assert s.get("up") == b"1"
    finally:
        p.terminate()
        assert p.wait(20) == 0
    pids = [
        int(x)
        for x in subprocess.run(
            ["pgrep", "-P", str(p.pid)], capture_output=True, text=True
        ).stdout.split()
    ]
    assert pids == []  # the servers stopped with it


def test_a_local_cluster_whose_drawn_port_was_taken_starts_on_new_ports(tmp_path):
    """A port drawn free and bound by another process before the server bound it (the
    OS hands ephemeral ports out again): the cluster starts again on new ones, and a
    server that fails for any other reason still fails at once."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        cluster = LocalCluster(tmp_path / "a", servers=1)
        taken = held.getsockname()[1]
        cluster.ports[0] = taken
        with cluster as c:
            assert c.ports[0] != taken
            assert isinstance(connect_store(c.address), NatsStore)
        assert "address already in use" in (tmp_path / "a" / "n0.log").read_text().lower()
    finally:
        held.close()
    broken = LocalCluster(tmp_path / "b", servers=1)
    broken.binary = sys.executable  # (exits at once: not a nats-server)
    with pytest.raises(StoreUnreachable, match="exited"):
        broken.start(timeout_s=10)
