"""The torchft lighthouse rule (pure) and BusLighthouse over real gRPC with torchft's own
client: a replica the bus reports dead leaves the next quorum at once."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from fastft.integrations.torchft import BusLighthouse, LighthouseOptions
from fastft.integrations.torchft.quorum import (
    QuorumMember,
    QuorumState,
    compute_quorum,
    fastft_replica_id,
    parse_replica_id,
    quorum_changed,
)
from fastft.protocol import Fault, ProcessExited, Severity

OPT = LighthouseOptions(min_replicas=1)


def _state(
    now: float, joined: list[str], beating: list[str], prev: list[str] | None
) -> QuorumState:
    st = QuorumState()
    for r in beating:
        st.heartbeats[r] = now - 0.1
    for r in joined:
        st.participants[r] = (now - 0.05, QuorumMember(r))
    st.prev = tuple(QuorumMember(r) for r in prev) if prev is not None else None
    return st


def test_replica_ids_round_trip() -> None:
    rid = fastft_replica_id(3, 12345, "train_ddp_3") + ":uuid-1"
    assert parse_replica_id(rid) == (3, 12345)
    assert parse_replica_id("train_ddp_3:uuid") is None


def test_fast_quorum_when_every_previous_member_asks() -> None:
    st = _state(100.0, ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"])
    members, why = compute_quorum(100.0, st, OPT)
    assert members is not None and [m.replica_id for m in members] == ["a", "b", "c"]
    assert why.startswith("fast")


def test_dead_but_heartbeating_replica_stalls_torchft_rule_until_expiry() -> None:
    # torchft's rule: c died 0.1 s ago, its heartbeat is fresh: the survivors wait.
    st = _state(100.0, ["a", "b"], ["a", "b", "c"], ["a", "b", "c"])
    assert compute_quorum(100.0, st, OPT)[0] is None
    # ... until its heartbeat expires (5 s by default; a and b keep beating).
    st.heartbeats.update(a=104.9, b=104.9)
    assert compute_quorum(100.0 + 5.0, st, OPT)[0] is not None
    st.heartbeats.update(a=99.9, b=99.9)
    # fastft's addition: reported dead on the bus, it is out at once.
    st.dead.add("c")
    members, _ = compute_quorum(100.0, st, OPT)
    assert members is not None and [m.replica_id for m in members] == ["a", "b"]


def test_new_quorum_id_after_a_failed_commit() -> None:
    # torchft's rule: same members, same id (no process-group rebuild) ...
    a = (QuorumMember("a"), QuorumMember("b"))
    assert not quorum_changed(a, a)
    assert quorum_changed((QuorumMember("a"),), a)
    assert quorum_changed(a, None)
    # ... unless a member failed its last commit: its peers may hold an abandoned
    # collective on the old communicator, so every member must rebuild it
    failed = (QuorumMember("a", commit_failures=1), QuorumMember("b"))
    assert quorum_changed(failed, a)


def test_split_brain_and_min_replicas() -> None:
    st = _state(100.0, ["a"], ["a", "b", "c", "d"], None)
    assert compute_quorum(200.0, st, OPT)[0] is None  # 1 of 4 live replicas
    st = _state(100.0, ["a", "b"], ["a", "b"], None)
    assert compute_quorum(100.0, st, LighthouseOptions(min_replicas=3))[0] is None


def test_join_timeout_waits_for_stragglers() -> None:
    st = _state(100.0, ["a", "b"], ["a", "b", "c"], None)
    assert compute_quorum(100.0, st, OPT)[0] is None
    st.heartbeats.update(a=159.9, b=159.9, c=159.9)  # c beats but never asks
    assert compute_quorum(100.0 + 60.0, st, OPT)[0] is not None


def test_the_first_quorum_waits_for_every_replica_started() -> None:
    # torchft's rule: the two replicas that are up start alone; the third, slower to
    # import torch, is not heartbeating yet and heals from them later
    st = _state(100.0, ["a", "b"], ["a", "b"], None)
    assert compute_quorum(100.0, st, OPT)[0] is not None
    # under fastft run: the launcher started 3, so the first quorum waits for the third ...
    first3 = LighthouseOptions(min_replicas=1, first_quorum=3)
    members, why = compute_quorum(100.0, st, first3)
    assert members is None and why.startswith("first quorum: 2 of 3")
    st.heartbeats["c"] = 101.0
    st.participants["c"] = (101.0, QuorumMember("c"))
    members, _ = compute_quorum(101.0, st, first3)
    assert members is not None and [m.replica_id for m in members] == ["a", "b", "c"]
    # ... at most the join timeout
    st = _state(100.0, ["a", "b"], ["a", "b"], None)
    st.heartbeats.update(a=159.9, b=159.9)
    assert compute_quorum(100.0 + 60.0, st, first3)[0] is not None
    # and only the first: later quorums shrink at once, as torchft's
    st = _state(100.0, ["a", "b"], ["a", "b"], ["a", "b", "c"])
    assert compute_quorum(100.0, st, first3)[0] is not None


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_ms"):
        LighthouseOptions(heartbeat_timeout_ms=0)
    with pytest.raises(ValueError, match="first_quorum"):
        LighthouseOptions(first_quorum=-1)


@pytest.mark.timeout(60)
def test_bus_lighthouse_serves_torchft_clients_and_drops_the_dead() -> None:
    from torchft._torchft import LighthouseClient

    ids = [fastft_replica_id(r, 7 + r, f"train_{r}") + ":u" for r in range(3)]
    with BusLighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=1)) as lh:
        client = LighthouseClient(lh.address, timedelta(seconds=5))
        results: dict[str, object] = {}

        def ask(rid: str, step: int) -> None:
            results[rid] = LighthouseClient(lh.address, timedelta(seconds=5)).quorum(
                replica_id=rid, timeout=timedelta(seconds=20), step=step
            )

        for rid in ids:  # all three heartbeat first, then ask together
            client.heartbeat(rid)
        threads = [threading.Thread(target=ask, args=(rid, 4)) for rid in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        q1 = results[ids[0]]
        assert sorted(p.replica_id for p in q1.participants) == sorted(ids)  # type: ignore[attr-defined]

        # Replica 2 dies. Its heartbeat is still fresh; without the bus the others would
        # wait 5 s for it. The agent's report drops it now.
        hdr = dict(job="j", epoch=0, rank=-1, incarnation=1)
        lh.on_message(ProcessExited(**hdr, exited_rank=2, exited_incarnation=9, signal=9))
        results.clear()
        threads = [threading.Thread(target=ask, args=(rid, 5)) for rid in ids[:2]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4)  # well under the 5 s heartbeat timeout
        assert set(results) == set(ids[:2])
        q2 = results[ids[0]]
        assert sorted(p.replica_id for p in q2.participants) == sorted(ids[:2])  # type: ignore[attr-defined]
        assert q2.quorum_id == q1.quorum_id + 1  # type: ignore[attr-defined]

        # A replica's own report that it is dying (uncaught exception) counts as well,
        # and a later heartbeat from that life does not bring it back.
        lh.on_message(
            Fault(
                job="j",
                epoch=0,
                rank=1,
                incarnation=8,
                severity=Severity.FAULT1,
                cause="uncaught_exception",
                faulty_rank=1,
                faulty_incarnation=8,
            )
        )
        client.heartbeat(ids[1])
        results.clear()
        ask(ids[0], 6)
        q3 = results[ids[0]]
        assert [p.replica_id for p in q3.participants] == [ids[0]]  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_a_joiner_is_announced_once_while_the_members_do_not_ask() -> None:
    """Members that reuse their quorum (ManagerFFT's leases) do not ask the lighthouse:
    it tells them, once per quorum issued, that a replica outside the last quorum waits."""
    from torchft._torchft import LighthouseClient

    ids = [fastft_replica_id(r, 7 + r, f"train_{r}") + ":u" for r in range(3)]
    announced: list[str] = []
    waiting: list[tuple[str, int, int]] = []
    results: dict[str, object] = {}
    with BusLighthouse(
        "127.0.0.1:0",
        LighthouseOptions(min_replicas=1),
        on_join=announced.append,
        on_waiting=lambda rid, step, qid: waiting.append((rid, step, qid)),
    ) as lh:

        def ask(rid: str, step: int) -> None:
            results[rid] = LighthouseClient(lh.address, timedelta(seconds=5)).quorum(
                replica_id=rid, timeout=timedelta(seconds=20), step=step
            )

        def ask_together(rids: list[str], step: int) -> list[threading.Thread]:
            threads = [threading.Thread(target=ask, args=(rid, step)) for rid in rids]
            for t in threads:
                t.start()
            return threads

        beats = LighthouseClient(lh.address, timedelta(seconds=5))
        for rid in ids[:2]:
            beats.heartbeat(rid)
        for t in ask_together(ids[:2], 4):  # the first quorum: nobody to announce
            t.join(30)
        assert set(results) == set(ids[:2]) and announced == []

        # A third replica asks while the two members run on their lease: announced, once
        # (its request is still waiting: the members have not asked).
        joiner = ask_together(ids[2:], 0)
        deadline = time.monotonic() + 10
        while not announced and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a few lighthouse ticks: no second announcement
        assert announced == [ids[2]] and ids[2] not in results
        # Told, the members ask: the joiner is in their quorum. The first of them to wait
        # is announced too (peers still in a reused step at or past 9 must void it).
        results.clear()
        first = ask_together(ids[:1], 9)
        deadline = time.monotonic() + 10
        while not waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting == [(ids[0], 9, 1)], waiting
        for t in [*first, *ask_together(ids[1:2], 9), *joiner]:
            t.join(30)
        q = results[ids[0]]
        assert sorted(p.replica_id for p in q.participants) == sorted(ids)  # type: ignore[attr-defined]
        assert len(waiting) == 1  # once per quorum
        # A member asking again is no joiner.
        for t in ask_together(ids, 10):
            t.join(30)
        assert announced == [ids[2]]
