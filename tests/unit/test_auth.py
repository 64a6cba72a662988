"""The job secret (issue 21): sealed bus frames, the replay guard, signed store values, and
the decision a forgery pre-empted."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastft.bus.signed import ForgedValue, SignedStore
from fastft.errors import ConfigError, ProtocolError
from fastft.protocol import Fault, Inject, JobKeys, Role, Severity, decode, encode
from fastft.protocol.auth import (
    SKEW_S,
    Forged,
    JobSecret,
    MessageAuth,
    ReplayGuard,
    ValueAuth,
)
from fastft.runtime.engine import decisions
from fastft.runtime.engine.coordinator import Coordinator
from fastft.testing import MemoryBus, MemoryHub, MemoryStore, wait_for

JOB = "sec"
SECRET = JobSecret(b"0123456789abcdef0123456789abcdef")


def _fault(**kw) -> Fault:
    base = dict(
        job=JOB, epoch=1, rank=-1, incarnation=7, role=Role.MONITOR,
        severity=Severity.FAULT1, cause="forged", faulty_rank=1,
    )  # fmt: skip
    return Fault(**{**base, **kw})


# --- the secret ------------------------------------------------------------------------------
def test_secret_file_is_private_and_hidden(tmp_path):
    p = JobSecret.draw().save(tmp_path / "s")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    s = JobSecret.load(p)
    assert "<hidden>" in repr(s) and p.read_text().strip() not in repr(s)
    with pytest.raises(ConfigError, match="exists"):
        JobSecret.draw().save(p)
    os.chmod(p, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        JobSecret.load(p)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16"):
        JobSecret.load(short)
    with pytest.raises(ConfigError, match="fastft secret new"):
        JobSecret.load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="fastft run"):
        JobSecret.for_worker(None)


def test_keys_differ_by_purpose_and_secret():
    other = JobSecret(b"another secret of enough bytes!!")
    assert SECRET.key("bus") != SECRET.key("store") != other.key("store")


# --- frames ----------------------------------------------------------------------------------
def _pair(secret_b: JobSecret | None = SECRET):
    hub = MemoryHub()
    a = MemoryBus(hub, JOB, rank=0, incarnation=1, secret=SECRET).start()
    b = MemoryBus(hub, JOB, rank=1, incarnation=2, secret=secret_b).start()
    got: list = []
    b.subscribe(got.append)
    return a, b, got


def test_sealed_frames_are_delivered():
    a, b, got = _pair()
    try:
        a.broadcast(_fault(rank=0, incarnation=1, role=Role.WORKER))
        assert wait_for(lambda: len(got) == 1, 2)
        assert b.stats.delivered == 1 and b.stats.forged == 0
    finally:
        a.close()
        b.close()


def test_frames_without_the_secret_are_counted_logged_once_and_not_acted_on(caplog):
    a, b, got = _pair()
    a.close()  # b alone listens
    hub = b._transport.hub
    stranger = MemoryBus(hub, JOB, rank=-1, incarnation=7, role=Role.OPERATOR, subscribe=False)
    wrong = MemoryBus(
        hub, JOB, rank=-1, incarnation=8, secret=JobSecret(b"x" * 32), subscribe=False
    )
    try:
        stranger.start()
        wrong.start()
        caplog.set_level(logging.ERROR, logger="fastft.bus.endpoint")
        for _ in range(3):
            stranger.broadcast(_fault())
            stranger.broadcast(
                Inject(
                    job=JOB,
                    epoch=0,
                    rank=-1,
                    incarnation=7,
                    role=Role.OPERATOR,
                    target_rank=1,
                    fault_kind="sigkill",
                    at_step=-1,
                    arg=0.0,
                )  # fmt: skip
            )
        wrong.broadcast(_fault(incarnation=8))
        assert wait_for(lambda: b.stats.forged == 7, 2), b.stats
        assert got == [] and b.stats.delivered == 0
        assert b.stats.rejected_by == {  # (as each message's header claims)
            "rank -1 incarnation 7 monitor": 3,
            "rank -1 incarnation 7 operator": 3,
            "rank -1 incarnation 8 monitor": 1,
        }
        lines = [r.getMessage() for r in caplog.records if "dropped a frame" in r.message]
        assert len(lines) == 3, lines  # once per sender
    finally:
        for e in (a, b, stranger, wrong):
            e.close()


def test_a_replayed_frame_is_rejected():
    a, b, got = _pair()
    sent: list[bytes] = []
    push = a._transport.push_all
    a._transport.push_all = lambda data: (sent.append(data), push(data))[1]  # type: ignore[method-assign]
    try:
        a.broadcast(_fault(rank=0, incarnation=1, role=Role.WORKER))
        assert wait_for(lambda: len(got) == 1, 2)
        push(sent[0])  # captured, then sent again
        assert wait_for(lambda: b.stats.replayed == 1, 2)
        assert len(got) == 1
        a.broadcast(_fault(rank=0, incarnation=1, role=Role.WORKER))  # the stream goes on
        assert wait_for(lambda: len(got) == 2, 2)
    finally:
        a.close()
        b.close()


def test_concurrent_broadcasts_from_one_endpoint_are_never_taken_for_replays():
    """The agent reports two deaths from two threads at once: the frames must leave in the
    order of their sequence numbers (a death notice was dropped as a replay, and the
    survivors waited out the rollback deadline for it)."""
    a, b, got = _pair()
    seal = a._auth.seal  # type: ignore[union-attr]
    a._auth.seal = lambda data, nonce: (time.sleep(0.002), seal(data, nonce))[1]  # type: ignore[union-attr,method-assign]
    try:
        senders = [
            threading.Thread(
                target=lambda: [a.broadcast(_fault(rank=0, incarnation=1)) for _ in range(25)]
            )
            for _ in range(4)
        ]
        for t in senders:
            t.start()
        for t in senders:
            t.join(10)
        assert wait_for(lambda: len(got) == 100, 5), (len(got), b.stats)
        assert b.stats.replayed == 0
        assert [m.seq for m in got] == sorted(m.seq for m in got)
    finally:
        a.close()
        b.close()


def test_replay_guard_rules():
    g = ReplayGuard(started_at=1000.0)
    s = (1, 0, 5, b"n" * 8)
    assert g.check(s, 3, 1000.0) is None
    assert "after 3" in g.check(s, 3, 1000.0)
    assert "after 3" in g.check(s, 2, 1000.0)
    assert g.check(s, 4, 1000.0) is None
    old = (1, 0, 6, b"m" * 8)
    assert "before this receiver started" in g.check(old, 1, 1000.0 - SKEW_S - 1)
    assert g.check(old, 1, 1000.0 - SKEW_S + 1) is None
    small = ReplayGuard(0.0, senders=2)
    for i in range(3):
        small.check((1, 0, i, b"x" * 8), 1, 0.0)
    assert len(small._last) == 2


_AUTH = MessageAuth(SECRET)
_VALID = _AUTH.seal(encode(_fault(seq=1, wall_time=1.0)), b"12345678")


def _open(frame: bytes):
    body, _ = _AUTH.open(frame)
    return decode(body, job=JOB)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=400),
        st.integers(0, len(_VALID) - 1).map(lambda n: _VALID[:n]),
        st.tuples(st.integers(0, len(_VALID) * 8 - 1)).map(
            lambda t: (
                _VALID[: t[0] // 8]
                + bytes([_VALID[t[0] // 8] ^ (1 << (t[0] % 8))])
                + _VALID[t[0] // 8 + 1 :]
            )
        ),
    )
)
def test_fuzzed_frames_raise_only_the_protocol_error_and_reach_no_one(frame):
    with pytest.raises(ProtocolError):
        _open(frame)
    hub = MemoryHub()
    b = MemoryBus(hub, JOB, rank=1, incarnation=2, secret=SECRET)
    got: list = []
    b._callbacks.append(got.append)
    b._deliver(frame)  # what the listener does with any bytes
    assert got == [] and b.stats.delivered == 0
    assert b.stats.forged + b.stats.malformed == 1


def test_the_untouched_frame_opens():
    assert _open(_VALID) == _fault(seq=1, wall_time=1.0)
    with pytest.raises(Forged):
        MessageAuth(JobSecret(b"y" * 32)).open(_VALID)


# --- store values ----------------------------------------------------------------------------
def test_values_are_bound_to_their_key():
    va = ValueAuth(SECRET)
    k1, k2 = "fastft/j/rt/1/0/decision", "fastft/j/rt/1/1/decision"
    v = va.sign(k1, "C")
    assert va.verify(k1, v) == "C" and va.verify(k1, v.encode()) == "C"
    assert va.verify(k2, v) is None  # moved to another key
    assert va.verify(k1, "C") is None and va.verify(k1, "C#00") is None
    assert va.verify(k1, "C#\u00e9\u00e9") is None and va.verify(k1, b"C#\xff\xfe") is None
    assert va.sign(k1, "") == "" and va.verify(k1, "") == ""
    assert ValueAuth(JobSecret(b"z" * 32)).verify(k1, v) is None


def test_signed_keys():
    k = JobKeys("j")
    signed = [k.decision(1, 2), k.epoch_members(3), k.epoch_arrival(3, 1), k.latest_epoch,
              k.joiner(0), k.committed, k.finished, k.node_lost(1), k.node_lives(1),
              k.leaving(1, 2, 0)]  # fmt: skip
    unsigned = [k.votes(1, 2), k.node_lease(1), k.bus_members, k.bus_queue("3"),
                k.pg_prefix(2) + "x", k.bus_ids]  # fmt: skip
    assert all(k.signed(x) for x in signed)
    assert not any(k.signed(x) for x in unsigned)


def _coord(raw: MemoryStore, rank: int = 0) -> Coordinator:
    s = SignedStore(raw, JobKeys(JOB), ValueAuth(SECRET))
    return Coordinator(s, JobKeys(JOB), rank, rank + 1, 2, 2, decision_store=s.clone())


def test_a_forged_decision_that_came_first_is_replaced_not_applied(caplog):
    raw = MemoryStore()
    key = JobKeys(JOB).decision(1, 5)
    raw.set(key, "Rforged")  # a stranger pre-empts step 5 with a rollback
    a, b = _coord(raw, 0), _coord(raw.clone(), 1)
    with caplog.at_level(logging.ERROR, logger="fastft.bus.signed"):
        assert b.await_decision(1, 5) is None  # a forged value is no decision
    assert a.vote(1, 5, 2) is None
    assert b.vote(1, 5, 2) == "C"  # the completing vote replaced the forgery
    assert a.await_decision(1, 5) == "C"
    assert bytes(raw.get(key)).startswith(b"C#")
    assert "without the job secret" in caplog.text


def test_a_forged_rollback_proposal_is_replaced_too():
    raw = MemoryStore()
    keys = JobKeys(JOB)
    raw.set(keys.decision(1, 6), "C")
    s = SignedStore(raw, keys, ValueAuth(SECRET))
    assert decisions.propose_rollback(s, keys, 1, 6, "a fault") == "Ra fault"


def test_forged_epochs_and_joiners_are_ignored():
    raw = MemoryStore()
    keys = JobKeys(JOB)
    c = _coord(raw)
    raw.set(keys.latest_epoch, "9")
    raw.set(keys.epoch_members(1), '{"epoch": 1}')
    raw.set(keys.finished, "3")
    raw.set(keys.joiner(1), "77")
    assert c.latest_epoch() == 0 and c.closed(1) is None and c.finished_at() is None
    assert c.joiners() == {}
    c.store.set(keys.joiner(1), "78")
    assert c.joiners() == {1: 78}
    assert c.store.forged.total >= 4


def test_signed_store_passes_other_keys_through():
    raw = MemoryStore()
    s = SignedStore(raw, JobKeys(JOB), ValueAuth(SECRET))
    k = JobKeys(JOB).votes(1, 1)
    assert s.add(k, 2) == 2 and raw.get(k) == b"2"
    s.set(JobKeys(JOB).committed, "4")
    assert raw.get(JobKeys(JOB).committed) != b"4" and s.get(JobKeys(JOB).committed) == b"4"
    with pytest.raises(ForgedValue):
        raw.set(JobKeys(JOB).committed, "5")
        s.get(JobKeys(JOB).committed)


def test_a_frame_is_bound_to_its_sequence_number():
    # the endpoint stamps seq and wall_time: a sealed frame cannot be given a new one
    m = replace(_fault(), seq=9, wall_time=2.0)
    frame = _AUTH.seal(encode(m), b"abcdefgh")
    moved = encode(replace(m, seq=10))
    tampered = moved + frame[len(moved) :]
    assert tampered != frame and len(tampered) == len(frame)
    with pytest.raises(Forged):
        _AUTH.open(tampered)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_in_a_signed_key_are_no_value_and_raise_nothing_else(raw):
    va = ValueAuth(SECRET)
    got = va.verify("fastft/j/rt/1/1/decision", raw)
    assert got is None or raw == b""
    s = SignedStore(MemoryStore(), JobKeys("j"), va)
    s.raw.set("fastft/j/rt/1/1/decision", raw)
    if raw:
        with pytest.raises(ForgedValue):
            s.get("fastft/j/rt/1/1/decision")
