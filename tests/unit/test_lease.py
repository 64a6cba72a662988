"""ManagerFFT's quorum leases as a table (pure): what breaks a lease, which leased step a
message voids, when a step asks the lighthouse."""

from __future__ import annotations

from types import SimpleNamespace

from fastft.integrations.torchft.lease import LeaseTable, Reused

A, B = (0, 1), (1, 5)


def _quorum(at_max: int = 2) -> SimpleNamespace:
    return SimpleNamespace(max_world_size=at_max, replica_world_size=2, quorum_id=3)


def _leased(every: int = 4) -> LeaseTable:
    """A table whose step 1 asked, got an eligible quorum and committed."""
    t = LeaseTable(quorum_every=every)
    t.begin_attempt()
    assert t.reuse(1) is None and t.asked_step == 1
    assert t.quorum(_quorum(), {A, B}) == set()
    t.end_attempt(True)
    assert t.lease is not None
    return t


def test_a_committed_eligible_quorum_is_reused_until_the_nth_step():
    t = _leased(every=4)
    t.begin_attempt()
    q = t.reuse(2)
    assert isinstance(q, Reused) and q.max_step == 2 and t.leased_step == 2 and t.reused == 1
    t.end_attempt(True)
    t.begin_attempt()
    assert t.reuse(4) is None  # every 4th step asks


def test_a_quorum_with_a_heal_or_a_dead_member_is_not_leased():
    t = LeaseTable(quorum_every=4)
    t.begin_attempt()
    t.reuse(1)
    t.quorum(_quorum(at_max=1), {A, B})
    t.end_attempt(True)
    assert t.lease is None
    t.dead.add(B)
    t.begin_attempt()
    t.reuse(2)
    assert t.quorum(_quorum(), {A, B}) == {B} and t.candidate is None


def test_a_break_voids_a_leased_step_at_or_past_its_step_only():
    t = _leased()
    t.begin_attempt()
    t.reuse(2)
    assert not t.break_(void_from=None)  # a join: the lease ends, the step completes
    assert t.lease is None
    t = _leased()
    t.begin_attempt()
    t.reuse(2)
    assert not t.break_(void_from=3) and t.break_(void_from=2)


def test_a_quorum_asked_before_a_break_is_not_leased():
    t = LeaseTable(quorum_every=4)
    t.begin_attempt()
    t.reuse(1)
    t.break_()
    t.quorum(_quorum(), {A, B})
    t.end_attempt(True)
    assert t.lease is None


def test_a_member_waiting_in_the_lighthouse_voids_a_later_leased_step_not_an_asking_one():
    t = _leased()
    t.begin_attempt()
    t.reuse(2)
    assert t.waiting(2) and t.lease is None
    t = _leased()
    t.begin_attempt()
    assert t.reuse(4) is None  # asking
    assert not t.waiting(4)


def test_a_rollback_nobody_told_is_reported_once():
    t = _leased()
    t.begin_attempt()
    t.reuse(2)
    assert t.end_attempt(False) is False and t.lease is None
    t.begin_attempt()
    t.told = True
    assert t.end_attempt(False) is True
