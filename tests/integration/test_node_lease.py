"""Node leases: the pure watch (time comes in as arguments) and the lease thread against a
real TCPStore."""

from __future__ import annotations

import threading
import time

import pytest

from fastft.bus import host_store
from fastft.errors import ConfigError
from fastft.launch.nodes.lease import GUARD_MIN_S, NodeLease
from fastft.launch.rules.leasewatch import LeaseConfig, LeaseWatch
from fastft.launch.rules.lives import declared_lives, format_lives, lost_mark, parse_lives
from fastft.launch.settings.config import LaunchConfig
from fastft.protocol.keys import JobKeys

CFG = LeaseConfig(heartbeat_ms=100, misses=3)


def test_a_lease_not_renewed_for_misses_heartbeats_expires_once():
    w = LeaseWatch(0, CFG, now=0.0)
    assert w.round(0.1, {1: 1, 2: 1}).expired == []
    assert w.round(0.2, {1: 2, 2: 1}).expired == []
    assert w.round(0.3, {1: 3, 2: 1}).expired == []
    v = w.round(0.4, {1: 4, 2: 1})  # node 2 last moved at 0.1: 300 ms ago
    assert v.expired == [2] and w.lost == {2}
    assert w.round(0.5, {1: 5, 2: 1}).expired == []  # said once
    v = w.round(0.6, {1: 6, 2: 2})  # it renews again: back
    assert v.returned == [2] and w.lost == set()


def test_every_other_node_lost_leaves_this_one_alone_until_one_returns():
    # (issue 60, case 4: the store's host cut off from every other node was never told)
    w = LeaseWatch(0, CFG, now=0.0)
    assert not w.all_lost()  # (nobody seen yet)
    w.round(0.1, {1: 1, 2: 1})
    w.round(0.2, {1: 2, 2: 1})
    w.round(0.3, {1: 2, 2: 1})
    assert w.round(0.4, {1: 2, 2: 1}).expired == [2] and not w.all_lost()  # node 1 lives
    w.round(0.5, {1: 2, 2: 1})
    assert w.round(0.6, {1: 2, 2: 1}).expired == [1] and w.all_lost()
    assert w.round(0.7, {1: 3, 2: 1}).returned == [1] and not w.all_lost()


def test_a_node_that_never_started_and_this_node_itself_are_not_watched():
    w = LeaseWatch(0, CFG, now=0.0)
    for t in range(1, 20):
        v = w.round(t * 0.1, {0: 1, 1: 0})
        assert v.expired == [] and v.store_lost is None


def test_a_late_round_blames_nobody_for_this_agents_own_pause():
    w = LeaseWatch(0, CFG, now=0.0)
    w.round(0.1, {1: 1})
    # this agent was stopped for 2 s: node 1's counter did not move *as seen from here*
    assert w.round(2.1, {1: 1}).expired == []
    assert w.round(2.2, {1: 1}).expired == []
    assert w.round(2.3, {1: 1}).expired == []
    w.round(2.38, {1: 1})
    assert w.round(2.45, {1: 1}).expired == [1]  # 350 ms of silence, seen on time


def test_the_store_is_lost_after_a_whole_lease_of_failed_rounds():
    w = LeaseWatch(1, CFG, now=0.0)
    w.round(0.1, {0: 1})
    assert w.round(0.2, None, "reset").store_lost is None
    assert w.round(0.3, None, "reset").store_lost is None
    v = w.round(0.4, None, "Connection reset by peer")
    assert v.store_lost is not None and "Connection reset by peer" in v.store_lost
    assert "300 ms" in v.store_lost


def test_one_answer_resets_the_count_of_failed_rounds():
    w = LeaseWatch(1, CFG, now=0.0)
    for t in (0.1, 0.2):
        w.round(t, None, "slow")
    w.round(0.3, {0: 3})
    assert w.round(0.4, None, "slow").store_lost is None


def test_lives_round_trip_and_junk_is_skipped():
    assert parse_lives(format_lives({3: 7, 1: 5})) == {1: 5, 3: 7}
    assert parse_lives(b"1:5,junk,x:1,2:") == {1: 5}


def test_a_lost_mark_names_the_lives_it_declared_dead():
    assert declared_lives(lost_mark(41, 0, {2: 9, 3: 4})) == {2: 9, 3: 4}
    assert declared_lives(lost_mark(41, 0, {})) == {}  # (a node without workers)
    assert declared_lives("41@0") is None  # an earlier version's: every worker


@pytest.mark.parametrize("ms, misses", [(5, 3), (100, 1), (100_000, 3)])
def test_bad_lease_settings_fail_at_start(ms, misses):
    with pytest.raises(ConfigError, match="--node-"):
        LeaseConfig(ms, misses)
    with pytest.raises(ConfigError, match="--node-"):
        LaunchConfig(command=("x.py",), node_heartbeat_ms=ms, node_lease_misses=misses)


@pytest.mark.timeout(30)
def test_leases_over_a_real_store_declare_fence_and_clear():
    """Two nodes' lease threads: node 1 stops renewing (closed), node 0 declares it lost
    with its lives; node 1 started again finds the mark, clears it, and is back."""
    store = host_store()
    keys = JobKeys("lease")
    try:
        store.set(keys.node_lives(1), format_lives({1: 11}))
        got: list[tuple] = []
        done = threading.Event()

        def lost(node: int, lives: dict[int, int], counter: int) -> None:
            got.append((node, lives))
            done.set()

        def never(*a: object) -> None:
            raise AssertionError(a)

        a = NodeLease(store, keys, 0, 2, CFG, on_lost=lost, on_fenced=never, on_store_lost=never)
        b = NodeLease(store, keys, 1, 2, CFG, on_lost=never, on_fenced=never, on_store_lost=never)
        a.start()
        b.start()
        time.sleep(0.5)
        assert got == []  # both renew
        b.close()
        assert done.wait(5)
        assert got == [(1, {1: 11})]
        assert declared_lives(bytes(store.get(keys.node_lost(1))).decode()) == {1: 11}
        b2 = NodeLease(store, keys, 1, 2, CFG, on_lost=never, on_fenced=never, on_store_lost=never)
        assert b2.rejoined and bytes(store.get(keys.node_lost(1))).decode() == ""
        a.close()
    finally:
        del store


@pytest.mark.timeout(30)
def test_a_standby_takes_its_node_over_once_and_never_after_a_declaration():
    """A standby told to go declares the lives its node's dead agent left (no mark left:
    the node is back); one that finds the node declared lost already declares nothing."""
    store = host_store()
    keys = JobKeys("takeover")
    try:
        store.set(keys.node_lives(1), format_lives({2: 21, 3: 31}))

        def never(*a: object) -> None:
            raise AssertionError(a)

        b = NodeLease(store, keys, 1, 2, CFG, on_lost=never, on_fenced=never, on_store_lost=never)
        assert b.take_over() == {2: 21, 3: 31}
        assert bytes(store.get(keys.node_lost(1))).decode() == ""  # (cleared: back)
        store.set(keys.node_lost(1), lost_mark(5, 0, {2: 22}))  # (a watcher was first)
        b2 = NodeLease(store, keys, 1, 2, CFG, on_lost=never, on_fenced=never, on_store_lost=never)
        assert b2.rejoined and b2.take_over() is None
    finally:
        del store


@pytest.mark.parametrize(
    "nnodes, rank, control, match",
    [(1, 0, None, "--nnodes > 1"), (2, 0, None, "node 0 only with")],
)
def test_a_standby_for_a_single_node_or_a_tcpstore_host_fails_at_start(
    nnodes, rank, control, match, tmp_path
):
    from fastft.protocol.auth import JobSecret

    secret = tmp_path / "s"
    JobSecret.draw().save(str(secret))
    with pytest.raises(ConfigError, match=match):
        LaunchConfig(
            command=("x.py",),
            standby=True,
            nnodes=nnodes,
            node_rank=rank,
            store="127.0.0.1:1",
            job_secret_file=str(secret),
        )
    LaunchConfig(  # (node 1 of 2: a standby for it is fine)
        command=("x.py",),
        standby=True,
        nnodes=2,
        node_rank=1,
        store="127.0.0.1:1",
        job_secret_file=str(secret),
    )


def test_a_standbys_go_line_sets_variables_and_its_end_dismisses_it():
    import io

    from fastft.launch.procs.standby import wait_for_go

    assert wait_for_go(io.StringIO('{"CUDA_VISIBLE_DEVICES": "2,3"}\n')) == {
        "CUDA_VISIBLE_DEVICES": "2,3"
    }
    assert wait_for_go(io.StringIO("go\n")) == {} and wait_for_go(io.StringIO("[1]\n")) == {}
    assert wait_for_go(io.StringIO("")) is None


class _Cut:
    """A store whose calls, once ``cut`` is set, wait until ``back`` is: a host cut off
    (its TCP connection up, no answer, no error)."""

    def __init__(self, store: object, cut: threading.Event, back: threading.Event) -> None:
        self._store, self._cut, self._back = store, cut, back

    def clone(self) -> _Cut:
        return _Cut(self._store.clone(), self._cut, self._back)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._store, name)
        if not callable(attr) or name == "set_timeout":
            return attr

        def call(*a: object, **k: object) -> object:
            if self._cut.is_set():
                self._back.wait(30)
            return attr(*a, **k)

        return call


def test_a_store_that_stops_answering_is_lost_though_no_call_returns():
    """A round blocked in a call to a store cut off never ends: the guard, from the
    time of the last answer, calls it lost (issue 50: the other nodes once said nothing
    until Gloo's 60 s)."""
    store = host_store()
    cut, back, lost = threading.Event(), threading.Event(), threading.Event()
    why: list[str] = []

    def on_store_lost(reason: str, silent: bool) -> None:
        why.append(reason)
        assert silent  # (it stopped answering: no call failed)
        lost.set()

    try:
        lease = NodeLease(
            _Cut(store, cut, back), JobKeys("cut"), 0, 2, CFG, on_lost=lambda *a: None,
            on_fenced=lambda *a: None, on_store_lost=on_store_lost,
        )  # fmt: skip
        lease.start()
        time.sleep(0.5)
        assert not lost.is_set()  # it answers
        t = time.monotonic()
        cut.set()
        assert lost.wait(10)
        took = time.monotonic() - t
        assert GUARD_MIN_S <= took < GUARD_MIN_S + 1.5, took
        assert len(why) == 1 and "did not answer" in why[0], why
        back.set()
        lease.close()
        assert len(why) == 1  # once, though the round's own verdict may come later
    finally:
        back.set()
        del store


def test_the_first_round_after_the_store_failed_blames_nobody():
    """While nobody can write (a NATS leader election), no lease moves: the first round
    that reaches the store again gives every node a fresh lease."""
    cfg = LeaseConfig(heartbeat_ms=100, misses=3, store_grace_s=15.0)
    w = LeaseWatch(0, cfg, now=0.0)
    w.round(0.1, {1: 1})
    for t in range(2, 30):  # 2.8 s of failed rounds: not lost yet (grace 15 s)
        assert w.round(t * 0.1, None, "no responders").store_lost is None
    assert w.round(3.0, {1: 1}).expired == []
    assert w.round(3.1, {1: 1}).expired == []
    assert w.round(3.2, {1: 1}).expired == []
    w.round(3.28, {1: 1})
    assert w.round(3.35, {1: 1}).expired == [1]


def test_each_node_is_watched_by_its_next_predecessors_and_past_lost_ones():
    from fastft.launch.rules.leasewatch import WATCHERS, watched

    assert watched(0, 3, {}) == [1, 2]  # (a small job: every other node)
    assert watched(5, 8, {}) == [6, 7, 0]
    assert watched(5, 8, {7: "12@6"}) == [6, 7, 0, 1]  # past a lost one (still read)
    assert watched(5, 8, {6: "done", 7: "done", 0: "done", 1: "3@2"}) == [6, 7, 0, 1, 2, 3, 4]
    # every node is watched by WATCHERS others: reads per round O(nodes), not O(nodes^2)
    n = 64
    watchers = {m: [a for a in range(n) if m in watched(a, n, {})] for m in range(n)}
    assert all(len(w) == WATCHERS for w in watchers.values())


@pytest.mark.timeout(60)
def test_a_lost_node_is_declared_by_its_watchers_in_a_larger_job():
    """Eight nodes' lease threads over a real store: node 5 stops; one of its watchers
    (2, 3, 4) declares it, once; no other node is blamed."""
    store = host_store()
    keys = JobKeys("lease8")
    try:
        got: list[tuple[int, int]] = []
        done = threading.Event()

        def never(*a: object) -> None:
            raise AssertionError(a)

        def lost_by(me: int):
            def lost(node: int, lives: dict[int, int], counter: int) -> None:
                got.append((me, node))
                done.set()

            return lost

        for n in range(8):
            store.set(keys.node_lives(n), format_lives({n: 100 + n}))
        leases = [
            NodeLease(
                store, keys, n, 8, CFG, on_lost=lost_by(n), on_fenced=never, on_store_lost=never
            )
            for n in range(8)
        ]
        for lease in leases:
            lease.start()
        time.sleep(0.6)
        assert got == []
        leases[5].close()
        assert done.wait(10)
        time.sleep(0.5)
        assert [node for _, node in got] == [5] and got[0][0] in (2, 3, 4)
        assert sorted(leases[0].running()) == [1, 2, 3, 4, 6, 7]
        for i, lease in enumerate(leases):
            if i != 5:
                lease.close()
    finally:
        del store


@pytest.mark.timeout(30)
def test_a_watched_node_whose_agent_ended_is_told_and_so_is_its_return():
    """Node 1's agent ends (its mark says done: the job's end or a drain); node 0's lease
    tells its agent once, and again when a new agent on node 1 clears the mark."""
    store = host_store()
    keys = JobKeys("done")
    try:
        told: list[tuple[int, bool]] = []

        def never(*a: object) -> None:
            raise AssertionError(a)

        a = NodeLease(
            store, keys, 0, 2, CFG, on_lost=never, on_fenced=never, on_store_lost=never,
            on_done=lambda n, done: told.append((n, done)),
        )  # fmt: skip
        b = NodeLease(store, keys, 1, 2, CFG, on_lost=never, on_fenced=never, on_store_lost=never)
        a.start(), b.start()
        time.sleep(0.3)
        store.compare_set(keys.node_lost(1), "", "done")  # (what NodeWatch.finish writes)
        b.close()
        deadline = time.monotonic() + 5
        while not told and time.monotonic() < deadline:
            time.sleep(0.02)
        assert told == [(1, True)]
        b2 = NodeLease(store, keys, 1, 2, CFG, on_lost=never, on_fenced=never, on_store_lost=never)
        b2.start()
        while len(told) < 2 and time.monotonic() < deadline + 5:
            time.sleep(0.02)
        assert told == [(1, True), (1, False)]
        a.close(), b2.close()
    finally:
        del store
