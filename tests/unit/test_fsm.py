"""The step state machine: every path of the seed's diagram as a scenario, the table's
completeness, random event sequences, and the generated doc being current."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastft.fsm import (
    TABLE,
    AbortProcessGroup,
    ApplyCommit,
    BroadcastDrainNotice,
    CancelFutures,
    CastVote,
    CommitApplied,
    ConfigureProcessGroup,
    Deadline,
    Decision,
    DrainAcked,
    DrainNoticed,
    DrainRequested,
    ExitWorker,
    FetchState,
    FormEpoch,
    GradsReady,
    HealDone,
    InterruptStep,
    InvalidTransition,
    JoinRequested,
    LocalFault,
    PeerFault,
    Phase,
    ProposeRollback,
    QuorumReady,
    ReportFault,
    RollbackRequested,
    SendDrainAck,
    SendState,
    Shutdown,
    StateLoaded,
    StepState,
    ZeroGrads,
    decide,
    initial_state,
)
from fastft.fsm.doc import render
from fastft.protocol import Severity

F1, F2 = Severity.FAULT1, Severity.FAULT2
ALL = frozenset({0, 1, 2})


def run(state: StepState, *events):
    actions = []
    for ev in events:
        state, acts = decide(state, ev)
        actions.extend(acts)
    return state, actions


def kinds(actions):
    return [type(a) for a in actions]


def normal(rank=0, members=ALL, step=0, epoch=1):
    s, _ = run(initial_state(rank), QuorumReady(epoch, members, step))
    assert s.phase is Phase.NORMAL
    return s


def test_init_to_normal_configures_the_process_group():
    s, acts = run(initial_state(0), QuorumReady(1, ALL, 5))
    assert s.phase is Phase.NORMAL and s.step == 5 and s.epoch == 1
    assert acts == [ConfigureProcessGroup(1)]


def test_fault_free_step_commits_and_increments():
    s, acts = run(normal(), GradsReady(), Decision(commit=True), CommitApplied())
    assert s.phase is Phase.NORMAL and s.step == 1
    assert acts == [CastVote(1, 0, False), ApplyCommit(0)]


ROLLBACK = [InterruptStep, AbortProcessGroup, CancelFutures, ZeroGrads, FormEpoch]


def test_vote_no_rolls_back_and_forms_the_next_epoch_at_once():
    """No barrier on the bus (issue 35): the formation's arrivals are the barrier, so a
    rollback sends nothing to the peers (they heard of the fault as this worker did)."""
    s, acts = run(normal(), GradsReady(), Decision(commit=False))
    acts = acts[1:]  # (the vote)
    assert s.phase is Phase.HEALING and s.forming and s.reason == "decision: rollback"
    assert kinds(acts) == ROLLBACK
    assert acts[-1] == FormEpoch(exclude=frozenset(), lost_state=False, rollback=True)
    s, acts = run(s, QuorumReady(2, ALL, 0))
    assert s.phase is Phase.NORMAL and s.step == 0 and s.epoch == 2  # same step again


def test_fault2_of_a_peer_skips_state_transfer():
    s, acts = run(normal(), PeerFault(2, F2, "exception"))
    assert s.phase is Phase.HEALING and not s.dead
    assert kinds(acts) == [InterruptStep, ProposeRollback, *ROLLBACK[1:]]
    s, acts = run(s, QuorumReady(2, ALL, 0))
    assert s.phase is Phase.NORMAL
    assert not any(isinstance(a, (FetchState, SendState)) for a in acts)


def test_fault1_of_a_peer_excludes_it_and_heals_its_replacement():
    s, acts = run(normal(), PeerFault(2, F1, "sigkill"))
    assert 2 in s.dead
    assert s.phase is Phase.HEALING
    assert acts[-1] == FormEpoch(exclude=frozenset({2}), lost_state=False, rollback=True)
    # the restarted rank 2 joins the next epoch and needs state: survivors send it
    s, acts = run(s, QuorumReady(2, ALL, 0, needs_state=frozenset({2})))
    assert s.phase is Phase.HEALING
    assert acts == [ConfigureProcessGroup(2), SendState(2, 0)]
    s, _ = run(s, HealDone())
    assert s.phase is Phase.NORMAL and not s.dead


def test_with_a_source_named_only_it_sends_and_the_bystanders_step_on() -> None:
    """A heal in a group of its own: the source sends, the receiver fetches, and a member
    that is neither goes on with the step at once (its allreduce waits for them)."""
    e = QuorumReady(2, ALL, 7, needs_state=frozenset({2}), source=0)
    s, acts = run(initial_state(0), e)
    assert s.phase is Phase.HEALING
    assert acts == [ConfigureProcessGroup(2), SendState(2, 7)]
    s, acts = run(initial_state(1), e)
    assert s.phase is Phase.NORMAL and s.step == 7
    assert acts == [ConfigureProcessGroup(2)]
    s, acts = run(initial_state(2), e)
    assert s.phase is Phase.HEALING and s.lost_state
    assert acts == [ConfigureProcessGroup(2), FetchState(2, 7)]
    # the bystander's step is a normal one: a fault of the receiver rolls it back
    s, _ = run(initial_state(1), e)
    s, acts = run(s, PeerFault(2, F1, "died while healing"))
    assert s.phase is Phase.HEALING and any(isinstance(a, InterruptStep) for a in acts)


def test_restarted_worker_fetches_state_before_its_first_step():
    s, acts = run(initial_state(2), QuorumReady(3, ALL, 17, needs_state=frozenset({2})))
    assert s.phase is Phase.HEALING and s.lost_state
    assert acts == [ConfigureProcessGroup(3), FetchState(3, 17)]
    with pytest.raises(InvalidTransition):
        decide(s, GradsReady())  # S4: no contribution before the heal
    s, _ = run(s, HealDone())
    assert s.phase is Phase.NORMAL and s.step == 17 and not s.lost_state


def test_a_pending_heal_steps_but_votes_only_once_the_rest_is_loaded():
    """HealDone(pending): all but the optimizer state arrived. The worker runs its step
    (NORMAL) but still counts as having lost its state: no vote before StateLoaded (S4),
    and a fault meanwhile asks for a heal again."""
    s, _ = run(initial_state(2), QuorumReady(3, ALL, 17, needs_state=frozenset({2}), source=0))
    s, _ = run(s, HealDone(pending=True))
    assert s.phase is Phase.NORMAL and s.lost_state
    with pytest.raises(InvalidTransition):
        decide(s, GradsReady())
    ok, acts = run(s, StateLoaded(), GradsReady())
    assert ok.phase is Phase.PREPARED and not ok.lost_state and acts == [CastVote(3, 17, False)]
    s, acts = run(s, PeerFault(0, F1, "the source died"))
    assert s.phase is Phase.HEALING
    assert acts[-1] == FormEpoch(exclude=frozenset({0}), lost_state=True, rollback=True)
    # a sender's HealDone is never pending for it: it holds the state
    s, _ = run(initial_state(0), QuorumReady(3, ALL, 17, needs_state=frozenset({2}), source=0))
    s, _ = run(s, HealDone(pending=True))
    assert s.phase is Phase.NORMAL and not s.lost_state


def test_local_fault1_marks_own_state_lost_and_asks_for_heal():
    s, acts = run(normal(), LocalFault(F1, "state lost"))
    assert s.lost_state
    assert acts[-1] == FormEpoch(exclude=frozenset(), lost_state=True, rollback=True)


def test_fault_after_our_vote_lets_the_store_decide():
    s, acts = run(normal(), GradsReady(), PeerFault(1, F2, "late"))
    assert s.phase is Phase.PREPARED and s.pending_fault
    assert kinds(acts) == [CastVote, InterruptStep, ProposeRollback]
    # the commit won the compare-and-set: apply it, then roll back the next step
    s, acts = run(s, Decision(commit=True))
    assert s.phase is Phase.COMMIT and acts == [ApplyCommit(0)]
    s, acts = run(s, CommitApplied())
    assert s.phase is Phase.HEALING and s.step == 1


def test_fault_between_decision_and_application_is_latched():
    s, _ = run(normal(), GradsReady(), Decision(commit=True))
    s, acts = run(s, PeerFault(2, F1, "sigkill"))
    assert s.phase is Phase.COMMIT and acts == []
    s, acts = run(s, CommitApplied())
    assert s.phase is Phase.HEALING and s.step == 1  # the commit stands (S1)
    assert ProposeRollback(1, 1, "fault after the commit decision") in acts


def test_two_ranks_failing_in_the_same_step():
    s, _ = run(
        normal(rank=0, members=frozenset({0, 1, 2, 3})),
        PeerFault(1, F1, "a"),
        PeerFault(2, F1, "b"),  # (while it forms: noted; the closer leaves it out)
    )
    assert s.phase is Phase.HEALING and s.dead == {1, 2}


def test_a_death_while_the_next_epoch_forms_is_left_to_the_formation():
    """No second rollback of the epoch being left: its closer leaves the dead member out,
    or the adoption of a view that admitted it feeds its death again, in the new epoch."""
    s, _ = run(normal(), PeerFault(2, F1, "x"))
    assert s.phase is Phase.HEALING and s.forming
    s, acts = run(s, PeerFault(1, F1, "again"))
    assert s.phase is Phase.HEALING and s.forming and s.dead == {1, 2} and acts == []
    # the view closed with rank 1 in it: entering it, then its death is a fault there
    s, _ = run(s, QuorumReady(2, frozenset({0, 1}), step=5))
    assert s.phase is Phase.NORMAL and s.epoch == 2 and not s.forming
    s, acts = run(s, PeerFault(1, F1, "died during formation"))
    assert s.phase is Phase.HEALING and s.epoch == 2
    assert acts[-1] == FormEpoch(exclude=frozenset({1}), lost_state=False, rollback=True)


def test_a_fault_during_a_heal_restarts_the_rollback():
    s, _ = run(normal(), PeerFault(2, F1, "x"))
    s, _ = run(s, QuorumReady(2, frozenset({0, 1, 2}), step=5, needs_state=frozenset({2})))
    assert s.phase is Phase.HEALING and not s.forming  # sending rank 2 its state
    s, acts = run(s, PeerFault(2, F1, "died while healing"))
    assert s.phase is Phase.HEALING and s.forming and s.epoch == 2
    assert kinds(acts) == ROLLBACK and acts[-1].exclude == {2}


def test_an_own_fault_while_the_next_epoch_forms_rolls_that_epoch_back_as_it_begins():
    """ft.run restarting its loop after an evaluation raised (on every rank): the fault
    came after the rollback of the epoch being left was over (with the bus barrier,
    rolling that one back again met nobody: CI). It is noted, and the new epoch rolls
    back as it begins; the peers hear of it again, as a fault of the new epoch."""
    s, _ = run(normal(), PeerFault(2, F2, "x"))
    assert s.phase is Phase.HEALING and s.forming
    s, acts = run(s, LocalFault(F1, "RuntimeError: an evaluation failed"))
    assert s.phase is Phase.HEALING and s.forming and s.refault and s.lost_state
    assert acts == []
    # its arrival may not have said the state was lost: the view heals nobody
    s, acts = run(s, QuorumReady(2, ALL, step=5))
    assert s.phase is Phase.HEALING and s.forming and s.epoch == 2
    assert s.lost_state and not s.refault
    assert acts[0] == ReportFault(2, "RuntimeError: an evaluation failed")
    assert ProposeRollback(2, 5, acts[2].reason) in acts
    # the peers roll the new epoch back on its report; the next one heals it
    assert acts[-1] == FormEpoch(exclude=frozenset(), lost_state=True, rollback=True)


def test_a_rollback_request_while_healing_is_a_rollback_of_the_new_epoch():
    """A request the inbox lets through while forming is a late one of the rollback just
    finished; once the epoch is adopted (its heal running) it is a new rollback of it."""
    s, _ = run(normal(), PeerFault(2, F1, "x"))
    s, acts = run(s, RollbackRequested(1))  # (the formation's reminder: it is in it)
    assert s.phase is Phase.HEALING and s.forming and acts == []
    s, _ = run(s, QuorumReady(2, ALL, step=5, needs_state=frozenset({2})))
    assert s.phase is Phase.HEALING and not s.forming
    s, acts = run(s, RollbackRequested(2))
    assert s.phase is Phase.HEALING and s.forming and s.epoch == 2 and kinds(acts) == ROLLBACK


def test_a_formations_reminder_rolls_back_a_member_still_in_the_step():
    """A member whose fault notice was lost waits in the step's collective; the first
    member to arrive at the next epoch's formation reminds it (a rollback request)."""
    s, acts = run(normal(rank=1), RollbackRequested(0))
    assert s.phase is Phase.HEALING and s.forming
    assert kinds(acts) == [InterruptStep, ProposeRollback, *ROLLBACK[1:]]
    # voted already: the decision in the store says what it was
    s, acts = run(normal(rank=1), GradsReady(), RollbackRequested(0))
    assert s.phase is Phase.PREPARED and s.pending_fault
    assert kinds(acts[1:]) == [InterruptStep, ProposeRollback]


def test_deadline_is_a_drains_only():
    """A rollback has no deadline of its own (the formation's closer declares members
    that never arrived): a Deadline outside DRAIN_WAIT is a stale timer."""
    s, _ = run(normal(), PeerFault(2, F2, "x"))
    s2, acts = run(s, Deadline(now=10.0))
    assert s2 == s and acts == []


def test_drain_path_commit_notice_acks_exit():
    s, acts = run(normal(), DrainRequested("preempted"), GradsReady())
    assert acts[-1] == CastVote(1, 0, True)
    s, acts = run(s, Decision(commit=True, leaving=frozenset({0})))
    assert s.phase is Phase.DRAIN_COMMIT
    s, acts = run(s, CommitApplied())
    assert s.phase is Phase.DRAIN_WAIT and isinstance(acts[0], BroadcastDrainNotice)
    s, acts = run(s, DrainAcked(1), DrainAcked(2))
    assert s.phase is Phase.EXIT and acts == [ExitWorker("drained")]


def test_survivors_of_a_drain_reform_without_rollback():
    s, _ = run(normal(rank=1), GradsReady(), Decision(commit=True, leaving=frozenset({0})))
    s, acts = run(s, CommitApplied())
    assert s.phase is Phase.HEALING and s.step == 1
    assert acts == [FormEpoch(exclude=frozenset({0}), lost_state=False)]
    s, acts = run(s, DrainNoticed(0))
    assert acts == [SendDrainAck(0)]


def test_a_drain_notice_before_the_decision_is_no_fault():
    """The leaver committed step 0 and said so before this member read the decision: the
    decision is a commit that lets it go, not a rollback."""
    s, _ = run(normal(rank=1), GradsReady())
    assert s.phase is Phase.PREPARED
    s, acts = run(s, DrainNoticed(0, step=0))
    assert acts == [SendDrainAck(0)] and s.phase is Phase.PREPARED and not s.pending_fault
    s, _ = run(s, Decision(commit=True, leaving=frozenset({0})))
    s, acts = run(s, CommitApplied())
    assert s.phase is Phase.HEALING and s.step == 1
    assert acts == [FormEpoch(exclude=frozenset({0}), lost_state=False)]
    # a notice of another step, unannounced: the leaver will not vote here: a fault
    s, _ = run(normal(rank=1), GradsReady())
    s, acts = run(s, DrainNoticed(0))
    assert s.pending_fault and any(isinstance(a, ProposeRollback) for a in acts)


def test_shutdown_from_everywhere():
    for phase in Phase:
        s, acts = decide(StepState(phase=phase, rank=0), Shutdown("bye"))
        assert s.phase is Phase.EXIT


def test_invalid_transition_names_phase_and_event():
    with pytest.raises(InvalidTransition, match="CommitApplied.*NORMAL"):
        decide(normal(), CommitApplied())
    with pytest.raises(InvalidTransition, match="Decision"):
        decide(normal(), Decision(commit=True))  # no commit without our vote


# Events that arrive from the network or from timers can come in any phase: each must
# have a row everywhere (never an InvalidTransition).
ASYNC_EVENTS = [
    PeerFault,
    RollbackRequested,
    DrainNoticed,
    DrainAcked,
    DrainRequested,
    Deadline,
    Shutdown,
    JoinRequested,
]


@pytest.mark.parametrize("event", ASYNC_EVENTS, ids=lambda e: e.__name__)
def test_asynchronous_events_are_defined_in_every_phase(event):
    for phase in Phase:
        assert (phase, event) in TABLE, f"{event.__name__} undefined in {phase.name}"


def test_table_targets_are_valid_phases():
    for rule in TABLE.values():
        assert rule.targets and all(isinstance(t, Phase) for t in rule.targets)
        assert rule.doc


def test_generated_doc_is_current():
    doc = Path(__file__).parents[2] / "docs" / "fsm.md"
    assert doc.read_text() == render(), "run: fastft fsm-doc > docs/fsm.md"


ranks = st.integers(0, 3)
events = st.one_of(
    st.builds(
        QuorumReady,
        st.integers(1, 5),
        st.frozensets(ranks, min_size=1),
        st.integers(0, 5),
        st.frozensets(ranks),
    ),
    st.just(GradsReady()),
    st.builds(LocalFault, st.sampled_from(Severity), st.just("x")),
    st.builds(PeerFault, ranks, st.sampled_from(Severity), st.just("x")),
    st.builds(RollbackRequested, ranks),
    st.builds(Decision, st.booleans(), st.frozensets(ranks)),
    st.just(CommitApplied()),
    st.builds(HealDone, st.booleans()),
    st.just(StateLoaded()),
    st.builds(DrainRequested),
    st.builds(DrainNoticed, ranks),
    st.builds(DrainAcked, ranks),
    st.builds(Deadline, st.floats(0, 100)),
    st.builds(JoinRequested, ranks),
)


@given(st.lists(events, max_size=60))
@settings(max_examples=400)
def test_random_event_sequences_stay_defined(seq):
    s = initial_state(0)
    for ev in seq:
        before = s
        try:
            s, actions = decide(s, ev)
        except InvalidTransition as e:
            assert e.phase is before.phase and e.event is ev
            assert (
                (before.phase, type(ev)) not in TABLE
                or isinstance(ev, Decision)
                or (
                    isinstance(ev, GradsReady) and before.lost_state  # a heal still pending
                )
            )
            continue
        assert isinstance(s.phase, Phase)
        assert s.phase in TABLE[(before.phase, type(ev))].targets
        # steps never go back within an epoch, and advance only by a commit
        if s.epoch == before.epoch and not isinstance(ev, QuorumReady):
            assert s.step in (before.step, before.step + 1)
            if s.step == before.step + 1:
                assert isinstance(ev, CommitApplied)
        if isinstance(ev, QuorumReady) and s.phase is Phase.INIT:  # left out: rejoin
            assert before.phase is Phase.HEALING and s.lost_state and s.rank not in ev.members
        elif isinstance(ev, QuorumReady) and s.phase is not Phase.EXIT:
            assert s.members == ev.members and not s.dead and s.epoch == ev.epoch
        if any(isinstance(a, ApplyCommit) for a in actions):
            assert before.phase is Phase.PREPARED and isinstance(ev, Decision) and ev.commit
        if s.phase is Phase.EXIT:
            break


def test_a_join_request_re_forms_the_epoch_once_the_decision_says_so():
    s, _ = decide(initial_state(0), QuorumReady(1, frozenset({0, 1}), 0))
    s, acts = decide(s, JoinRequested(2))
    assert s.phase is Phase.NORMAL and s.joining and acts == ()
    s, acts = decide(s, GradsReady())
    assert acts == (CastVote(1, 0, False, joining=True),)  # the request goes with the vote
    s, acts = decide(s, Decision(commit=True, admit=True))
    assert acts == (ApplyCommit(0),)
    s, acts = decide(s, CommitApplied())
    assert s.phase is Phase.HEALING and s.step == 1 and not s.joining
    assert acts == (FormEpoch(exclude=frozenset(), lost_state=False),)
    # a member's own duplicate request changes nothing
    s2, _ = decide(initial_state(0), QuorumReady(1, frozenset({0, 1}), 0))
    assert not decide(s2, JoinRequested(1))[0].joining


def test_joiners_left_out_of_an_elastic_retry_are_admitted_after_its_commit():
    # the epoch formed after a rollback left a registered joiner out (EpochView.waiting)
    s, acts = decide(initial_state(0), QuorumReady(2, frozenset({0, 1}), 5, waiting=True))
    assert s.phase is Phase.NORMAL and s.joining
    s, acts = decide(s, GradsReady())
    assert acts == (CastVote(2, 5, False, joining=True),)  # admitted after this step
    s, _ = decide(initial_state(0), QuorumReady(2, frozenset({0, 1}), 5))
    assert not s.joining


def test_a_join_request_latched_after_the_vote_waits_for_the_next_decision():
    """Regression (elastic demo, 60 s stall): one member re-formed on a request the others
    had not seen yet while they entered the next step's allreduce."""
    s, _ = decide(initial_state(0), QuorumReady(1, frozenset({0, 1}), 0))
    s, _ = decide(s, GradsReady())
    s, _ = decide(s, JoinRequested(2))  # after this member voted
    s, _ = decide(s, Decision(commit=True))  # nobody asked to admit with this step
    s, acts = decide(s, CommitApplied())
    assert s.phase is Phase.NORMAL and s.joining and acts == ()
    s, acts = decide(s, GradsReady())
    assert acts == (CastVote(1, 1, False, joining=True),)


def test_a_member_left_out_while_it_heals_itself_rejoins_instead_of_exiting():
    """An elastic world re-forms without a member that lost its state (an in-process
    restart): that member registers as a joiner again; one with its state is told to
    exit (CI once saw the in-process restart end its process: "not a member of epoch 3")."""
    s, _ = run(normal(rank=1), LocalFault(F1, "in-process restart"))
    assert s.phase is Phase.HEALING and s.lost_state
    s, acts = run(s, QuorumReady(2, frozenset({0, 2}), 0))
    assert s.phase is Phase.INIT and acts == [] and s.lost_state
    s, acts = run(s, QuorumReady(3, ALL, 1, frozenset({1})))
    assert s.phase is Phase.HEALING and FetchState(3, 1) in acts
    kept, _ = run(normal(rank=1), PeerFault(0, F2, "exception"))
    kept, acts = run(kept, QuorumReady(2, frozenset({0, 2}), 0))
    assert kept.phase is Phase.EXIT and "not a member of epoch 2" in acts[0].reason
