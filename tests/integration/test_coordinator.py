"""The store side of the runtime on a real TCPStore: one decision per step, and epochs."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from fastft.protocol.keys import JobKeys
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.endings import JobFinished
from fastft.runtime.engine import decisions
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.decisions import ADMIT, COMMIT, ROLLBACK, parse_commit
from fastft.runtime.engine.joiners import Joiners
from fastft.runtime.engine.survivors import Survivors

pytestmark = pytest.mark.timeout(60)
JOB = "coord"


def client(store: dist.TCPStore, timeout_s: float = 2.0) -> dist.TCPStore:
    # a short store timeout: a get that blocks on a missing key fails the test at once;
    # set after connecting, since torch 2.13 stalls about one new connection in 25 for 5 s
    # here (a reverse DNS lookup), which a 200 ms connect timeout would fail
    c = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30)
    )
    c.set_timeout(datetime.timedelta(seconds=timeout_s))
    return c


def coord(store: dist.TCPStore, rank: int, inc: int, world: int = 3) -> Coordinator:
    # one connection (torch 2.13 stalls every 25th one for 5 s), with a short timeout
    # that both bounds a decision wait and fails a get that would block on a missing key
    c = client(store, timeout_s=0.2)
    return Coordinator(c, JobKeys(JOB), rank, inc, world, world, decision_store=c)


def test_the_completing_vote_commits(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    for c in cs[:2]:
        assert c.vote(1, 0, 3) is None
    assert cs[0].await_decision(1, 0) is None  # not decided before the last vote
    assert cs[2].vote(1, 0, 3) == COMMIT  # the completing vote knows at once
    assert {c.await_decision(1, 0) for c in cs} == {COMMIT}


def test_a_rollback_proposed_first_beats_the_commit(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    keys = JobKeys(JOB)
    cs[0].vote(1, 5, 3)
    got = decisions.propose_rollback(cs[1].store, keys, 1, 5, "rank 2 died")
    assert got == ROLLBACK + "rank 2 died"
    cs[1].vote(1, 5, 3)
    # the completing vote finds the decision taken
    assert cs[2].vote(1, 5, 3) == ROLLBACK + "rank 2 died"
    assert {c.await_decision(1, 5) for c in cs} == {ROLLBACK + "rank 2 died"}
    # and a rollback after the commit does not change it
    for c in cs:
        c.vote(1, 6, 3)
    assert decisions.propose_rollback(cs[0].store, keys, 1, 6, "late") == COMMIT


def test_a_late_commit_is_confirmed_unless_a_rollback_came_first(store):
    """A step decided by its collective long after a member's last contact
    (:class:`fastft.fsm.GradsReady` ``confirm``): the first compare-and-set holds; a
    rollback a member proposed first (the others left the epoch while this member was cut
    off) turns the late commit into a rollback, and a store that cannot answer does too."""
    cs = [coord(store, r, 10 + r) for r in range(3)]
    keys = JobKeys(JOB)
    assert cs[0].confirm(2, 7) == COMMIT
    assert cs[1].confirm(2, 7) == COMMIT  # (another late member reads the same)
    assert decisions.propose_rollback(cs[2].store, keys, 2, 7, "late") == COMMIT
    assert decisions.propose_rollback(cs[2].store, keys, 2, 8, "node 1 lost") == (
        ROLLBACK + "node 1 lost"
    )
    assert cs[1].confirm(2, 8) == ROLLBACK + "node 1 lost"

    class Down:
        def compare_set(self, *a: object) -> None:
            raise TimeoutError("no answer within 0.8 s")

    cs[0].store = Down()
    got = cs[0].confirm(2, 9)
    assert got.startswith(ROLLBACK) and "TimeoutError: no answer within 0.8 s" in got


def test_forget_removes_a_decided_steps_keys(store):
    c = coord(store, 0, 1, world=1)
    assert c.vote(1, 0, 1) == COMMIT
    decisions.forget(c.store, JobKeys(JOB), 1, 0)
    assert c.await_decision(1, 0) is None


def test_cleared_joiner_keys_never_block_a_reader(store):
    """Regression: joiner keys were deleted once admitted; a reader between its check and
    its get of the key then blocked for the store's whole timeout (30 s in a job)."""
    c0, c1 = coord(store, 0, 100), coord(store, 1, 101)
    c1.register_joiner()
    assert c0.joiners() == {1: 101}
    c0.store.compare_set(JobKeys(JOB).joiner(1), "101", "")  # what admission and the agent do
    assert c0.joiners() == {}
    c0.dead.add(Member(1, 101))
    c1.register_joiner()
    assert c0.joiners() == {}, "a dead incarnation is never admitted"


def _join_all(cs: list[Coordinator]) -> list[EpochView | None]:
    out: list[EpochView | None] = [None] * len(cs)

    def run(i: int) -> None:
        joiners = Joiners(cs[i])
        for r in joiners.rounds(joiners.register(start_timeout_s=30, regroup_timeout_s=5.0)):
            out[i] = r.view

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return out


def test_first_start_forms_one_epoch_with_everyone(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    views = _join_all(cs)
    assert all(v is not None for v in views)
    assert len(set(views)) == 1
    v = views[0]
    assert v is not None and v.epoch == 1 and v.ranks == frozenset({0, 1, 2})
    assert v.source == 0 and v.needs_state == frozenset({1, 2})
    assert cs[0].joiners() == {}, "admitted joiners are cleared"


def test_survivors_exclude_the_dead_and_admit_its_restart(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    restarted = coord(store, 2, 99)
    restarted.register_joiner()
    v = _survive(cs[:2], first, dead=2, step=7)
    assert v is not None and v.epoch == 2 and v.step == 7
    assert v.members == (Member(0, 10), Member(1, 11), Member(2, 99))
    assert v.needs_state == frozenset({2}) and v.source == 0


def test_a_restart_that_registers_after_the_survivors_arrived_is_admitted_at_once(store):
    # The common order of a SIGKILL: the survivors arrive within milliseconds, the restarted
    # worker registers a fork (or a Python start) later. A fixed world waits for it; the
    # closer read the joiners only when the arrivals' count changed, so it found the
    # restart at the 5 s deadline, and every restart cost 5 s (session 12's regression).
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    restarted = coord(store, 2, 99)
    timer = threading.Timer(0.3, restarted.register_joiner)
    timer.start()
    t0 = time.monotonic()
    v = _survive(cs[:2], first, dead=2, step=7)
    timer.join()
    assert v is not None and v.members == (Member(0, 10), Member(1, 11), Member(2, 99))
    assert time.monotonic() - t0 < 2.5, "found the restart at the deadline (5 s), not at once"


def test_an_elastic_retry_leaves_a_restarted_worker_for_the_next_commit(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    for c in cs:
        c.min_members = 2
    restarted = coord(store, 2, 99)
    restarted.register_joiner()
    v = _survive(cs[:2], first, dead=2, step=7, admit=False)
    assert v is not None and v.members == (Member(0, 10), Member(1, 11))
    assert v.waiting == (2,) and v.needs_state == frozenset()
    assert EpochView.from_json(v.to_json()) == v
    assert cs[0].joiners() == {2: 99}, "still registered: admitted after the next commit"


def test_a_retry_below_min_replicas_still_admits_joiners(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    for c in cs:
        c.min_members = 3  # the survivors alone are too few
    restarted = coord(store, 2, 99)
    restarted.register_joiner()
    v = _survive(cs[:2], first, dead=2, step=7, admit=False)
    assert v is not None and Member(2, 99) in v.members and v.waiting == ()


def test_a_vote_with_a_join_request_makes_the_commit_admit_joiners(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    assert cs[0].vote(1, 3, 3) is None
    assert cs[1].vote(1, 3, 3, joining=True) is None  # only one member saw the request
    assert cs[2].vote(1, 3, 3) == COMMIT + ADMIT  # the completing vote knows from the count
    assert {c.await_decision(1, 3) for c in cs} == {COMMIT + ADMIT}


def test_a_vote_with_a_drain_names_the_leavers_in_the_commit(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    ranks = (0, 1, 2)
    assert cs[2].vote(1, 4, 3, leaving=True, ranks=ranks) is None
    assert cs[0].vote(1, 4, 3, leaving=True, joining=True, ranks=ranks) is None
    got = cs[1].vote(1, 4, 3, ranks=ranks)
    assert got == COMMIT + ADMIT + "L0,2"
    assert parse_commit(got) == (True, frozenset({0, 2}))
    assert parse_commit(COMMIT) == (False, frozenset())
    for bad in (ROLLBACK + "x", "CLx", "CQ", ""):
        assert parse_commit(bad) is None


def test_a_survivor_waiting_for_a_peer_that_finished_the_job_ends_too(store):
    # Ranks 0 and 2 applied the last commit (step 60) and closed; rank 1 took rank 0's
    # clean exit for a fault and re-forms. With too few members to close an epoch it would
    # wait for restarts forever; the finished mark ends its wait.
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    c = cs[1]
    c.min_members = 2

    t0 = c.clock()

    def form(step: int) -> EpochView | None:
        return _form(
            c,
            first,
            frozenset({0, 2}),
            step=step,
            lost_state=False,
            timeout_s=0.1,
            cancelled=lambda: c.clock() - t0 > 2.0,
        )

    cs[0].store.set(JobKeys(JOB).finished, "60")
    with pytest.raises(JobFinished) as e:
        form(60)
    assert e.value.step == 60 and e.value.code == 0
    # so does a worker behind the finished step (a fault cut its last step's collective
    # short while its peers committed it): nobody is left to heal it, nothing to train
    with pytest.raises(JobFinished) as e:
        form(59)
    assert e.value.step == 60 and e.value.code == 0


def test_survivors_offer_their_kept_gradients_in_the_view(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    for c in cs:
        c.min_members = 2  # elastic: the survivors go on without rank 2
    v = _survive(cs[:2], first, dead=2, step=7, kept={0: (0, 32, 96)})
    assert v is not None and v.kept == ((0, 0, 32, 96),)
    assert EpochView.from_json(v.to_json()) == v


def _form(
    c: Coordinator,
    prev: EpochView,
    exclude: frozenset[int],
    *,
    cancelled: Callable[[], bool],
    **arrival: Any,
) -> EpochView | None:
    """A survivor's formation as a worker's executor carries it out: its arrival, then its
    rounds until the view (None if ``cancelled()``); JobFinished if the job finished."""
    survivors = Survivors(c)
    wait = survivors.arrive(prev, exclude, **arrival)
    for r in survivors.rounds(wait):
        if r.finished is not None:
            raise JobFinished(r.finished)
        if r.view is not None:
            return r.view
        if cancelled():
            return None
    return None


def _survive(
    cs: list[Coordinator],
    prev: EpochView,
    *,
    dead: int,
    step: int,
    kept: dict[int, tuple[int, int, int]] | None = None,
    admit: bool = True,
) -> EpochView | None:
    """``cs`` form the epoch after ``prev`` without ``dead``, each in a thread; returns the
    view they all agreed on."""
    out: dict[int, EpochView | None] = {}

    def survive(c: Coordinator) -> None:
        out[c.me.rank] = _form(
            c,
            prev,
            frozenset({dead}),
            step=step,
            lost_state=False,
            timeout_s=5,
            cancelled=lambda: False,
            kept=(kept or {}).get(c.me.rank),
            admit=admit,
        )

    threads = [threading.Thread(target=survive, args=(c,)) for c in cs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    views = [out[c.me.rank] for c in cs]
    assert all(v == views[0] for v in views), views
    return views[0]


def test_a_member_that_died_after_arriving_is_left_out_at_once(store):
    # issue 25: rank 2 arrived for the next epoch, then died; its stale arrival counted,
    # the epoch closed with a dead member, and the restarted worker was killed 5 s later
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    keys = JobKeys(JOB)
    cs[2].store.set(keys.epoch_arrival(2, 2), '{"inc": 12, "step": 7, "lost": false}')
    dead = {Member(1, 11), Member(2, 12)}  # rank 1 died first, rank 2 after arriving
    cs[0].dead = dead
    cs[0].min_members = 1
    t0 = time.monotonic()
    v = _form(
        cs[0],
        first,
        frozenset({1}),
        step=7,
        lost_state=False,
        timeout_s=5,
        cancelled=lambda: False,
    )
    assert v is not None and v.members == (Member(0, 10),)
    assert time.monotonic() - t0 < 2.5, "waited for a survivor known dead"


def test_when_the_closer_dies_during_a_formation_the_next_survivor_closes(store):
    cs = [coord(store, r, 10 + r) for r in range(3)]
    first = _join_all(cs)[0]
    assert first is not None
    # rank 0 (the closer: the lowest survivor) dies once the formation without rank 2 began
    cs[1].dead = {Member(2, 12), Member(0, 10)}
    cs[1].min_members = 1
    t0 = time.monotonic()
    v = _form(
        cs[1], first, frozenset({2}), step=7, lost_state=False, timeout_s=5, cancelled=lambda: False
    )
    assert v is not None and v.members == (Member(1, 11),)
    assert time.monotonic() - t0 < 2.5, "waited for a dead closer"
