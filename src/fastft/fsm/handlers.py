"""The handlers of the step state machine's table (:mod:`fastft.fsm.table`): each computes
the new state and the actions of one (phase, event) row. Pure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fastft.fsm.contract import (
    AbortProcessGroup,
    Action,
    ApplyCommit,
    BroadcastDrainNotice,
    CancelFutures,
    CastVote,
    ConfigureProcessGroup,
    Decision,
    DrainAcked,
    DrainNoticed,
    DrainRequested,
    Event,
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
    StepState,
    ZeroGrads,
)
from fastft.protocol.messages import Severity

Result = tuple[StepState, tuple[Action, ...]]
Handler = Callable[[StepState, Event], Result]


# --- helpers -----------------------------------------------------------------------------


def _begin_rollback(s: StepState, reason: str, *, propose: bool) -> Result:
    """Roll the step back and form the next epoch: interrupt the step, make sure the
    decision is ROLLBACK, abandon the epoch's process group, drop the gradients.

    No barrier on the bus (issue 35: every member's request and acknowledgement to every
    other was 2N(N-1) deliveries a fault, 10 s a round at 256 members): every rollback
    begins with a message every member receives (a fault report, a death notice, a drain
    notice) or a decision every member reads, and the formation's arrival keys are the
    barrier. Its closer waits for every expected member or declares it dead at the
    deadline, and one arrived member reminds those missing (docs/architecture.md)."""
    actions: list[Action] = [InterruptStep(reason)]
    if propose:
        actions.append(ProposeRollback(s.epoch, s.step, reason))
    actions += [
        AbortProcessGroup(),
        CancelFutures(),
        ZeroGrads(),
        FormEpoch(exclude=s.dead | s.leaving, lost_state=s.lost_state, rollback=True),
    ]
    return replace(s, phase=Phase.HEALING, reason=reason, forming=True), tuple(actions)


def _note_fault(s: StepState, rank: int, severity: Severity) -> StepState:
    if severity is Severity.FAULT1:
        return replace(s, dead=s.dead | {rank})
    return s


def _enter_epoch(s: StepState, e: QuorumReady) -> Result:
    prev = s
    s = StepState(
        phase=Phase.HEALING,
        rank=s.rank,
        epoch=e.epoch,
        step=e.step,
        members=e.members,
        # (a state lost while the epoch formed: its arrival may not have said so)
        lost_state=s.rank in e.needs_state or (s.refault and s.lost_state),
        want_drain=s.want_drain,
        joining=e.waiting,
    )
    if prev.refault:
        # Its own fault came while the epoch formed (a worker that restarted its loop in
        # process): the rollback of the epoch being left was over, and the peers that
        # still formed noted it only (a rollback there would meet nobody). So the new
        # epoch rolls back as it begins, and the peers hear of the fault again, as one of
        # this epoch (a peer yet to adopt it keeps the message until it does: the inbox's
        # early messages). Found by the simulator ("escape"); in CI, once in a few runs,
        # the worker waited for the deadline and declared its live peers dead.
        cause = prev.reason or "a fault while the epoch formed"
        nxt, back = _begin_rollback(
            s, f"a fault as epoch {e.epoch} formed: {cause}"[:200], propose=True
        )
        return nxt, (ReportFault(e.epoch, cause), *back)
    actions: list[Action] = [ConfigureProcessGroup(e.epoch)]
    if not e.needs_state:
        return replace(s, phase=Phase.NORMAL), tuple(actions)
    if s.lost_state:
        actions.append(FetchState(e.epoch, e.step))
    elif e.source is None or e.source == s.rank:
        actions.append(SendState(e.epoch, e.step))
    else:  # a bystander of a heal between the source and the receivers: the step goes on
        return replace(s, phase=Phase.NORMAL), tuple(actions)
    return s, tuple(actions)


# --- handlers ----------------------------------------------------------------------------


def quorum_ready(s: StepState, e: Event) -> Result:
    assert isinstance(e, QuorumReady)
    if s.rank not in e.members:
        if s.lost_state and s.phase is Phase.HEALING:
            # left out while it heals itself in place (an elastic world goes on without
            # the members still to heal): it registers as a joiner, admitted and healed
            # at a later commit, instead of ending its process
            return replace(s, phase=Phase.INIT, members=frozenset()), ()
        return replace(s, phase=Phase.EXIT), (ExitWorker(f"not a member of epoch {e.epoch}"),)
    return _enter_epoch(s, e)


def heal_done(s: StepState, e: Event) -> Result:
    assert isinstance(e, HealDone)
    return replace(s, phase=Phase.NORMAL, lost_state=s.lost_state and e.pending, reason=""), ()


def state_loaded(s: StepState, e: Event) -> Result:
    return replace(s, lost_state=False), ()


def grads_ready(s: StepState, e: Event) -> Result:
    if s.lost_state:
        # a pending heal (HealDone) not yet loaded: voting now would commit a step on a
        # state this worker does not hold (S4); the caller must feed StateLoaded first
        raise InvalidTransition(s.phase, e)
    assert isinstance(e, GradsReady)
    vote = CastVote(
        s.epoch, s.step, s.want_drain, joining=s.joining, agreed=e.agreed, confirm=e.confirm
    )
    return replace(s, phase=Phase.PREPARED), (vote,)


def local_fault_running(s: StepState, e: Event) -> Result:
    assert isinstance(e, LocalFault)
    lost = s.lost_state or e.severity is Severity.FAULT1
    s = replace(s, lost_state=lost)
    if s.phase is Phase.PREPARED:
        # Our yes vote may already have completed a COMMIT; the store decides.
        return replace(s, pending_fault=True), (
            InterruptStep(e.cause),
            ProposeRollback(s.epoch, s.step, e.cause),
        )
    return _begin_rollback(s, e.cause, propose=True)


def local_fault_latched(s: StepState, e: Event) -> Result:
    assert isinstance(e, LocalFault)
    lost = s.lost_state or e.severity is Severity.FAULT1
    return replace(s, lost_state=lost, pending_fault=s.phase is Phase.COMMIT or s.pending_fault), ()


def local_fault_healing(s: StepState, e: Event) -> Result:
    assert isinstance(e, LocalFault)
    lost = s.lost_state or e.severity is Severity.FAULT1
    if s.forming:
        # The next epoch is being formed: a rollback of the epoch being left would meet
        # nobody (its peers are past it); the new one rolls back as it begins (refault).
        return replace(s, lost_state=lost, refault=True, reason=e.cause), ()
    return _begin_rollback(replace(s, lost_state=lost), e.cause, propose=False)


def peer_fault_normal(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    return _begin_rollback(_note_fault(s, e.rank, e.severity), e.cause, propose=True)


def peer_fault_prepared(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    s = replace(_note_fault(s, e.rank, e.severity), pending_fault=True)
    return s, (InterruptStep(e.cause), ProposeRollback(s.epoch, s.step, e.cause))


def peer_fault_latched(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    s = _note_fault(s, e.rank, e.severity)
    return replace(
        s, pending_fault=s.pending_fault or s.phase in (Phase.COMMIT, Phase.DRAIN_COMMIT)
    ), ()


def peer_fault_healing(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    if e.rank not in s.members:
        return s, ()
    if s.forming:
        # The next epoch is being formed: a member that died is left out by its closer, or,
        # if it was admitted before the closer knew, the view's adoption feeds its death
        # again, as a fault of the new epoch. A rollback of the epoch being left would not
        # meet the peers that adopted the new one: each waited for the other's requests
        # until the deadline declared it dead (found by the simulator). A faulty worker
        # that lives tells the new epoch again (StepState.refault).
        return _note_fault(s, e.rank, e.severity), ()
    return _begin_rollback(_note_fault(s, e.rank, e.severity), e.cause, propose=False)


def peer_fault_drain_wait(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    s = replace(s, dead=s.dead | {e.rank})
    if not s.members - s.dead - s.leaving - {s.rank}:
        # It holds the last copy of the committed state: it does not take it away. It
        # re-forms the epoch with the restarts, heals them and leaves from a later
        # formation, or at its next commit (found by the simulator: a drain's invariant).
        s = replace(s, phase=Phase.HEALING, acked=frozenset(), forming=True)
        return s, (FormEpoch(exclude=s.dead | s.leaving, lost_state=s.lost_state),)
    return drain_acked(s, DrainAcked(e.rank))


def rollback_req_normal(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    return _begin_rollback(s, f"rollback requested by rank {e.rank}", propose=True)


def rollback_req_prepared(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    s = replace(s, pending_fault=True)
    reason = f"rollback requested by rank {e.rank}"
    return s, (InterruptStep(reason), ProposeRollback(s.epoch, s.step, reason))


def rollback_req_healing(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    if s.forming:  # a late request (or reminder) of the rollback this worker finished
        return s, ()
    # A request of this epoch (the inbox keeps no other) while its heal runs: a rollback
    # of it, as a peer's fault would be (it is not past it: it only began)
    return _begin_rollback(s, f"rollback requested by rank {e.rank}", propose=False)


def rollback_req_latched(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    return replace(s, pending_fault=True), ()


def decision_prepared(s: StepState, e: Event) -> Result:
    assert isinstance(e, Decision)
    if not e.commit:
        s = replace(s, pending_fault=False)
        return _begin_rollback(s, s.reason or "decision: rollback", propose=False)
    # It leaves after this commit only if the decision names it (it voted with its drain):
    # a drain asked after its vote waits for the next one (it left unannounced, and its
    # peers rolled the step back: seen in the slow tier's drain tests, under load)
    leaves = s.want_drain and s.rank in e.leaving
    phase = Phase.DRAIN_COMMIT if leaves else Phase.COMMIT
    s = replace(s, phase=phase, leaving=s.leaving | (e.leaving - {s.rank}), admit=e.admit)
    return s, (ApplyCommit(s.step),)


def decision_rollback_only(s: StepState, e: Event) -> Result:
    assert isinstance(e, Decision)
    if e.commit:
        # Without our vote no commit can be decided: the caller mixed up steps or epochs.
        raise InvalidTransition(s.phase, e)
    if s.phase is Phase.NORMAL:
        return _begin_rollback(s, "decision: rollback", propose=False)
    return s, ()


def commit_applied(s: StepState, e: Event) -> Result:
    s = replace(s, step=s.step + 1, acked=frozenset(), reason="")
    if s.pending_fault or s.dead:
        s = replace(s, pending_fault=False)
        return _begin_rollback(s, "fault after the commit decision", propose=True)
    if s.leaving or s.admit:
        # Every survivor read the same decision (with the same leavers, and whether to
        # admit joiners) from the store: no barrier is needed to agree on re-forming.
        # Joiners are admitted by the formation itself (they registered in the store).
        # A join request latched after this member voted is not enough: the others may
        # not have seen it; it goes with the next vote.
        s = replace(
            s,
            phase=Phase.HEALING,
            dead=s.dead | s.leaving,
            joining=False,
            admit=False,
            forming=True,
        )
        return s, (FormEpoch(exclude=s.dead, lost_state=s.lost_state),)
    return replace(s, phase=Phase.NORMAL), ()


def drain_commit_applied(s: StepState, e: Event) -> Result:
    s = replace(s, phase=Phase.DRAIN_WAIT, step=s.step + 1, acked=frozenset({s.rank}))
    actions: tuple[Action, ...] = (BroadcastDrainNotice(s.epoch, s.step - 1, s.reason or "drain"),)
    return drain_acked(s, DrainAcked(s.rank), actions)


def drain_acked(s: StepState, e: Event, actions: tuple[Action, ...] = ()) -> Result:
    assert isinstance(e, DrainAcked)
    s = replace(s, acked=s.acked | {e.rank})
    if s.members <= s.acked | s.dead:
        return replace(s, phase=Phase.EXIT), (*actions, ExitWorker("drained"))
    return s, actions


def drain_deadline(s: StepState, e: Event) -> Result:
    """A leaver's acks did not all come within the timeout (a notice lost on the way, found
    by the simulator): it leaves anyway. Every member read the commit decision, which
    names it among the leavers, and takes its drained exit as its leaving."""
    return replace(s, phase=Phase.EXIT), (ExitWorker("drained"),)


def want_drain(s: StepState, e: Event) -> Result:
    assert isinstance(e, DrainRequested)
    return replace(s, want_drain=True, reason=e.reason or "drain"), ()


def drain_noticed(s: StepState, e: Event) -> Result:
    assert isinstance(e, DrainNoticed)
    known = e.rank in s.leaving
    s = replace(s, leaving=s.leaving | {e.rank})
    if known or e.rank not in s.members or s.phase in (Phase.COMMIT, Phase.HEALING):
        return s, (SendDrainAck(e.rank),)
    if s.phase is Phase.PREPARED and e.step == s.step:
        # It committed the step this worker voted on: the decision is a commit that lets it
        # go (read next, with the leavers), not a fault.
        return s, (SendDrainAck(e.rank),)
    # A leaver the decision did not announce will never vote on this step: drop it.
    reason = f"rank {e.rank} drained"
    s = replace(s, dead=s.dead | {e.rank})
    if s.phase is Phase.PREPARED:
        s = replace(s, pending_fault=True)
        return s, (
            SendDrainAck(e.rank),
            InterruptStep(reason),
            ProposeRollback(s.epoch, s.step, reason),
        )
    nxt, actions = _begin_rollback(s, reason, propose=True)
    return nxt, (SendDrainAck(e.rank), *actions)


def drain_noticed_ack_only(s: StepState, e: Event) -> Result:
    assert isinstance(e, DrainNoticed)
    return s, (SendDrainAck(e.rank),)


def join_requested(s: StepState, e: Event) -> Result:
    assert isinstance(e, JoinRequested)
    if e.rank in s.members and e.rank not in s.dead:
        return s, ()  # a member's own (late or duplicate) request: nothing to admit
    return replace(s, joining=True), ()


def ignore(s: StepState, e: Event) -> Result:
    return s, ()


def shutdown(s: StepState, e: Event) -> Result:
    assert isinstance(e, Shutdown)
    return replace(s, phase=Phase.EXIT), (ExitWorker(e.reason or "shutdown"),)


def exit_ignore(s: StepState, e: Event) -> Result:
    return s, ()
