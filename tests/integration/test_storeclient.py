"""The torch-free TCPStore client against torch's own store and client: every operation
the bus uses, both ways, so that a change in torch's wire protocol fails here."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from fastft.bus import connect_store
from fastft.bus.storeclient import QueueEmpty, StoreClient
from fastft.errors import StoreTimeout, StoreUnreachable


@pytest.fixture
def pair(store):
    """(ours, torch's client) on one store."""
    ours = StoreClient("127.0.0.1", store.port, timeout_s=5.0)
    theirs = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=5)
    )
    yield ours, theirs
    ours.close()


def test_set_get_both_ways(pair):
    ours, theirs = pair
    ours.set("a", b"\x00\xffbytes")
    assert bytes(theirs.get("a")) == b"\x00\xffbytes"
    theirs.set("b", "text")
    assert ours.get("b") == b"text"
    ours.set("a", b"")  # an empty value is a value
    assert bytes(theirs.get("a")) == b""


def test_add_is_one_counter_for_both(pair):
    ours, theirs = pair
    assert ours.add("n", 5) == 5
    assert theirs.add("n", -2) == 3
    assert ours.add("n", 0) == 3


def test_compare_set_semantics_match_torch(pair):
    ours, theirs = pair
    assert ours.compare_set("k", "", "v1") == b"v1"  # missing key, expected empty: set
    assert ours.compare_set("k", "wrong", "v2") == b"v1"  # mismatch: current value
    assert bytes(theirs.compare_set("k", "v1", "v2")) == b"v2"
    assert ours.compare_set("k", "v2", "v3") == b"v3"
    assert bytes(theirs.get("k")) == b"v3"
    assert ours.compare_set("missing", "x", "y") == bytes(theirs.compare_set("missing2", "x", "y"))


def test_check(pair):
    ours, theirs = pair
    theirs.set("here", "1")
    assert ours.check(["here"])
    assert not ours.check(["here", "not-here"])
    assert ours.check([])


def test_queues_both_ways_in_order(pair):
    ours, theirs = pair
    for i in range(3):
        ours.queue_push("q", f"m{i}".encode())
    # A push has no reply (as in torch's client): only a request on the same
    # connection is ordered after it, so ask ours first, then theirs.
    assert ours.queue_len("q") == 3 and theirs.queue_len("q") == 3
    assert bytes(theirs.queue_pop("q", block=False)) == b"m0"
    assert ours.queue_pop("q", block=False) == b"m1"
    theirs.queue_push("q", b"m3")
    assert ours.queue_pop("q") == b"m2"
    assert ours.queue_pop("q") == b"m3"
    with pytest.raises(QueueEmpty):
        ours.queue_pop("q", block=False)


def test_blocking_pop_is_woken_by_a_push(pair):
    ours, theirs = pair
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(ours.queue_pop("w")))
    t.start()
    theirs.queue_push("w", b"late")
    t.join(5.0)
    assert got == [b"late"]


def test_timeouts_leave_the_connection_usable(pair):
    ours, theirs = pair
    ours.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(StoreTimeout):
        ours.queue_pop("empty")
    with pytest.raises(StoreTimeout):
        ours.get("never-set")
    theirs.set("after", "ok")  # the cancelled waits left nothing unread on the stream
    assert ours.get("after") == b"ok"
    assert ours.add("c", 1) == 1


def test_clone_is_a_connection_of_its_own(pair):
    ours, theirs = pair
    c = ours.clone()
    c.set_timeout(datetime.timedelta(seconds=0.1))
    with pytest.raises(StoreTimeout):
        c.queue_pop("x")
    ours.set("y", "1")
    assert c.get("y") == b"1"
    c.close()


def test_connect_store_torch_free_gives_our_client(store):
    s = connect_store(f"127.0.0.1:{store.port}", timeout_s=5.0, torch_free=True)
    assert isinstance(s, StoreClient)
    s.set("z", "1")
    assert bytes(store.get("z")) == b"1"


def test_nothing_listening_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreUnreachable, match="no store answers"):
        StoreClient("127.0.0.1", port, timeout_s=1.0)


def test_a_peer_that_never_answers_the_handshake_is_not_a_store():
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        with pytest.raises(StoreUnreachable, match="does not answer as a store"):
            StoreClient("127.0.0.1", lst.getsockname()[1], timeout_s=0.3)
