"""The worker's inbox: bus messages become state-machine events (pure)."""

from __future__ import annotations

from fastft.fsm import (
    DrainAcked,
    DrainNoticed,
    DrainRequested,
    JoinRequested,
    LocalFault,
    PeerFault,
    RollbackRequested,
)
from fastft.protocol import (
    EXIT_DRAINED,
    DrainAck,
    DrainNotice,
    DrainRequest,
    Fault,
    HangSuspected,
    JoinRequest,
    ProcessExited,
    Role,
    RollbackRequest,
    Severity,
)
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.inbox import route

ME = Member(0, 10)
VIEW = EpochView(3, (Member(0, 10), Member(1, 11), Member(2, 12)), 5, frozenset(), 0)
HDR = dict(job="j", epoch=3, step=5)
AGENT = dict(HDR, rank=-1, incarnation=0, role=Role.AGENT)


def _route(m, view=VIEW, dead=frozenset(), finished=False):
    return route(m, me=ME, view=view, epoch=3, step=5, dead=dead, finished=finished, world_size=4)


def _exited(rank, inc, code=None, sig=9, ending=False):
    return ProcessExited(
        **AGENT, exited_rank=rank, exited_incarnation=inc, exit_code=code, signal=sig, ending=ending
    )


def test_a_peer_death_is_a_fault1_and_names_the_life_dead():
    out = _route(_exited(1, 11))
    assert out.events == (PeerFault(1, Severity.FAULT1, "rank 1 exited (signal 9)"),)
    assert out.dead == Member(1, 11)
    assert out.record is not None and out.record[0] == "peer_fault"


def test_one_death_several_messages_starts_one_recovery():
    hung = HangSuspected(**AGENT, hung_rank=1, hung_incarnation=11, silent_for_s=1.0, stopped=True)
    first = _route(hung)
    assert first.dead == Member(1, 11) and first.events
    again = _route(_exited(1, 11), dead={Member(1, 11)})
    assert again.events == () and again.dead is None


def test_a_monitors_report_of_the_current_life_then_its_exit_start_one_recovery():
    """`fastft report-error` names no life (incarnation 0: the rank's current one); the
    agent then kills that life, whose exit notice names it. Counted as two deaths, the
    second restarted the rollback of an epoch already re-formed, and the peers waited 60 s
    (issue 40)."""
    monitor = dict(HDR, rank=-1, incarnation=0, role=Role.MONITOR)
    report = Fault(**monitor, severity=Severity.FAULT1, cause="Xid 79", faulty_rank=1)
    first = _route(report)
    assert first.dead == Member(1, 11) and first.events
    again = _route(_exited(1, 11), dead={Member(1, 11)})
    assert again.events == () and again.dead is None


def test_an_older_life_is_dead_but_not_a_fault_of_this_epoch():
    out = _route(_exited(1, 7))
    assert out.events == () and out.dead == Member(1, 7)


def test_a_clean_exit_after_the_job_finished_is_an_end_not_a_fault():
    out = _route(_exited(1, 11, code=0, sig=None), finished=True)
    # (no fault; it counts as the ack of a member draining at that last commit)
    assert out.events == (DrainAcked(1),) and out.dead is None
    assert out.record[0] == "peer_finished"
    assert _route(_exited(1, 11, code=0, sig=None)).events[0] == PeerFault(
        1, Severity.FAULT1, "rank 1 exited (code 0)"
    )  # not finished: a fault


def test_a_monitor_reporting_this_worker_is_a_local_fault():
    f = Fault(
        **HDR,
        rank=-1,
        incarnation=5,
        role=Role.MONITOR,
        severity=Severity.FAULT2,
        cause="ecc",
        faulty_rank=0,
        faulty_incarnation=0,
    )
    (ev,) = _route(f).events
    assert isinstance(ev, LocalFault) and ev.severity is Severity.FAULT2 and "monitor" in ev.cause


def test_our_own_fault_and_the_agents_notice_of_our_exit_are_ignored():
    own = Fault(
        **HDR,
        rank=0,
        incarnation=10,
        severity=Severity.FAULT2,
        cause="x",
        faulty_rank=0,
        faulty_incarnation=10,
    )
    assert _route(own).events == ()
    assert _route(_exited(0, 10)).events == ()


def test_a_peer_reporting_its_own_fault1_lost_its_state_but_lives():
    f = Fault(
        **HDR,
        rank=1,
        incarnation=11,
        severity=Severity.FAULT1,
        cause="state lost",
        faulty_rank=1,
        faulty_incarnation=11,
    )
    out = _route(f)
    assert out.dead is None and out.events == (PeerFault(1, Severity.FAULT1, "state lost"),)


def test_rollback_requests_count_only_from_members_of_this_epoch():
    req = RollbackRequest(**HDR, rank=1, incarnation=11, reason="r")
    assert _route(req).events == (RollbackRequested(1),)
    stale = RollbackRequest(**dict(HDR, epoch=2), rank=1, incarnation=11, reason="r")
    assert _route(stale).events == ()
    stranger = RollbackRequest(**HDR, rank=1, incarnation=99, reason="r")
    assert _route(stranger).events == ()


def test_a_peers_own_transient_fault_of_an_epoch_left_is_stale():
    """The peer rolled that epoch back itself and arrived at the formation of this one:
    acted on, this worker alone would roll back an epoch its peers go on in (found by the
    simulator: "lone-rollback"). A death of an older epoch still counts (it is for
    good), and so does a monitor's report."""
    old = dict(HDR, epoch=HDR["epoch"] - 1, rank=1, incarnation=11)
    raised = Fault(**old, severity=Severity.FAULT2, cause="x", faulty_rank=1, faulty_incarnation=11)
    out = _route(raised)
    assert out.events == () and out.record[0] == "stale_fault"
    now = Fault(
        **dict(old, epoch=HDR["epoch"]),
        severity=Severity.FAULT2,
        cause="x",
        faulty_rank=1,
        faulty_incarnation=11,
    )
    assert _route(now).events == (PeerFault(1, Severity.FAULT2, "x"),)
    lost = Fault(**old, severity=Severity.FAULT1, cause="x", faulty_rank=1, faulty_incarnation=11)
    assert _route(lost).events == (PeerFault(1, Severity.FAULT1, "x"),)
    # ... unless this epoch heals it already (its arrival said it lost its state): acted
    # on, the worker re-formed alone and declared its live peers dead (the simulator:
    # two state losses 1 ms apart in a world of 3)
    heals_1 = EpochView(3, VIEW.members, 5, frozenset({1}), 2)
    out = _route(lost, view=heals_1)
    assert out.events == () and out.record[0] == "stale_fault"


def test_drains_and_joins():
    notice = DrainNotice(**HDR, rank=2, incarnation=12, reason="bye")
    assert _route(notice).events == (DrainNoticed(2, step=notice.step),)  # (the step it committed)
    assert _route(DrainAck(**HDR, rank=2, incarnation=12, drained_rank=0)).events == (
        DrainAcked(2),
    )
    assert _route(DrainAck(**HDR, rank=2, incarnation=12, drained_rank=1)).events == ()
    assert _route(JoinRequest(**HDR, rank=1, incarnation=77)).events == (JoinRequested(1),)


def test_a_leaver_of_an_epoch_already_left_behind_gets_its_ack_at_once():
    """This worker read the decision that let rank 3 go and formed epoch 3 without it
    before rank 3's notice (epoch 2) came: it acks outside the state machine, else the
    leaver waits out its grace (30 s). A notice of this epoch from a non-member, or one
    before any epoch, gets nothing."""
    late = DrainNotice(**dict(HDR, epoch=2), rank=3, incarnation=13, reason="bye")
    out = _route(late)
    assert out.events == () and out.ack_drain == 3
    assert out.record == ("drain_ack_late", {"rank": 3})
    assert _route(DrainNotice(**HDR, rank=3, incarnation=13)).ack_drain is None
    assert _route(late, view=None).ack_drain is None
    assert _route(DrainNotice(**HDR, rank=2, incarnation=12)).ack_drain is None  # a member


def test_joins_that_cannot_be_admitted_are_logged_not_acted_on():
    # a valid JoinRequest from rank 99 re-formed the epoch after every commit (issue 25)
    for m, why in (
        (JoinRequest(**HDR, rank=99, incarnation=77), "outside the world"),
        (JoinRequest(**HDR, rank=1, incarnation=11), "a member"),
        (JoinRequest(**HDR, rank=3, incarnation=5), "dead"),
    ):
        out = _route(m, dead={Member(3, 5)})
        assert out.events == () and out.record == ("join_ignored", {"rank": m.rank, "why": why})
    assert _route(JoinRequest(**HDR, rank=3, incarnation=6), dead={Member(3, 5)}).events


def test_before_the_first_epoch_only_deaths_are_noted():
    assert _route(JoinRequest(**HDR, rank=1, incarnation=77), view=None).events == ()
    out = _route(_exited(1, 11), view=None)
    assert out.events == () and out.dead == Member(1, 11)


def test_a_drained_exit_is_no_fault_when_expected_and_a_drain_request_is_latched():
    drained = _exited(1, 11, code=EXIT_DRAINED, sig=None, ending=True)
    expected = route(
        drained, me=ME, view=VIEW, epoch=3, step=5, dead=frozenset(), world_size=4, leaving={1}
    )
    assert expected.events == (DrainAcked(1),) and expected.dead == Member(1, 11)
    assert expected.record is not None and expected.record[0] == "peer_drained"
    outside = _route(_exited(1, 7, code=EXIT_DRAINED, sig=None, ending=True))  # (not a member)
    assert outside.events == (DrainAcked(1),) and outside.dead == Member(1, 7)
    # the script's own sys.exit(88), without fastft's record: a fault, expected drain or not
    own = _exited(1, 11, code=EXIT_DRAINED, sig=None)
    got = route(own, me=ME, view=VIEW, epoch=3, step=5, dead=frozenset(), world_size=4, leaving={1})
    assert got.events == (PeerFault(1, Severity.FAULT1, "rank 1 exited (code 88)"),)
    # a member this worker still counts on (it left from a formation): a fault like any exit
    assert _route(drained).events == (PeerFault(1, Severity.FAULT1, "rank 1 exited (code 88)"),)
    op = dict(HDR, rank=-1, incarnation=5, role=Role.OPERATOR)
    assert _route(DrainRequest(**op, target_rank=0, reason="maintenance")).events == (
        DrainRequested("maintenance"),
    )
    assert _route(DrainRequest(**op, target_rank=2)).events == ()  # not this worker
    assert _route(DrainRequest(**op, target_rank=0), view=None).events  # latched before an epoch


def test_a_flood_of_ignored_joins_is_logged_at_1_10_100():
    from fastft.runtime.engine.inbox import repeats_logged

    assert [n for n in range(-1, 1001) if repeats_logged(n)] == [1, 10, 100, 1000]


def test_a_rollback_of_an_epoch_not_adopted_yet_is_kept_for_it():
    """A peer that adopted epoch 4 first rolls it back (a reminder, its own fault report)
    while this worker still forms it: dropped, they left the peer waiting
    for the deadline (found by the simulator). They are kept, and routed again once this
    worker adopts a view; a monitor's report or an older epoch's is routed at once."""
    later = dict(job="j", epoch=4, step=5, rank=1, incarnation=11)
    kept = [
        RollbackRequest(**later, reason="x"),
        Fault(
            **later, severity=Severity.FAULT2, cause="raised", faulty_rank=1, faulty_incarnation=11
        ),
    ]
    for m in kept:
        assert _route(m).early and _route(m, view=None).early
    monitor = dict(job="j", epoch=4, step=5, rank=-1, incarnation=0, role=Role.MONITOR)
    report = Fault(**monitor, severity=Severity.FAULT1, cause="Xid 79", faulty_rank=1)
    assert not _route(report).early and _route(report).events
    same = RollbackRequest(**dict(later, epoch=3), reason="x")
    assert not _route(same).early and _route(same).events == (RollbackRequested(1),)
    # adopted: the same message is an event of this worker's epoch
    out = route(kept[0], me=ME, view=VIEW, epoch=4, step=5, dead=frozenset())
    assert not out.early and out.events == (RollbackRequested(1),)


def test_a_joiner_is_answered_by_the_first_members_of_a_live_epoch():
    """Issue 60, case 8: a restarted worker waited while the survivor (alone, compiling
    for its new shard) said nothing, then formed an epoch by itself and failed the job
    ("every holder of the committed state was lost"). The epoch's first members answer
    its request from their listener (a Heartbeat): it lives, so the joiner waits."""
    from fastft.runtime.engine.inbox import ALIVE_REPLIERS

    join = JoinRequest(**HDR, rank=3, incarnation=77)
    assert _route(join).alive  # rank 0: the epoch's first member
    many = EpochView(3, tuple(Member(r, 10 + r) for r in range(8)), 5, frozenset(), 0)
    answers = [
        route(join, me=m, view=many, epoch=3, step=5, dead=frozenset(), world_size=9).alive
        for m in many.members
    ]
    assert answers == [True] * ALIVE_REPLIERS + [False] * (8 - ALIVE_REPLIERS)
    assert not _route(join, view=None).alive  # (another joiner: no epoch to vouch for)
    assert not _route(JoinRequest(**HDR, rank=99, incarnation=77)).alive  # ignored
