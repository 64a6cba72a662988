"""The step state machine: ``decide(state, event) -> (state, actions)``.

The transition table :data:`TABLE` is data: for every (phase, event type) it names the
phases the transition may lead to and a pure handler that computes the new state and the
actions. A pair that is not in the table raises :class:`InvalidTransition` naming both.
``docs/fsm.md`` is generated from this table (``python -m fastft.fsm``).

Protocol summary (DESIGN "The state machine"): a step runs NORMAL -> PREPARED (grads ready,
vote yes) -> COMMIT (decision) -> NORMAL(step + 1). Any fault before the decision makes a
member propose ROLLBACK with a compare-and-set in the store; the store keeps exactly one
decision per (epoch, step). A member that knows of a fault and is not waiting for a decision
goes to ROLLBACK_REQ, where it collects a rollback request (or death) from every member;
then ROLLBACK_SYNC, the barrier in which process groups are aborted, futures cancelled and
gradients dropped; then HEALING, where the next epoch is formed without the dead and state
is sent to Fault1 members only; then NORMAL at the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fastft.fsm.contract import (
    AbortProcessGroup,
    Action,
    ApplyCommit,
    BroadcastDrainNotice,
    BroadcastRollbackAck,
    BroadcastRollbackRequest,
    CancelFutures,
    CastVote,
    CommitApplied,
    ConfigureProcessGroup,
    Deadline,
    Decision,
    DeclareDead,
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
    RollbackAcked,
    RollbackRequested,
    SendDrainAck,
    SendState,
    Shutdown,
    StateLoaded,
    StepState,
    ZeroGrads,
)
from fastft.protocol.messages import Severity

__all__ = ["decide", "initial_state", "Rule", "TABLE"]

Result = tuple[StepState, tuple[Action, ...]]
Handler = Callable[[StepState, Event], Result]


@dataclass(frozen=True)
class Rule:
    """One row of the table: the phases the transition may reach and what it does."""

    targets: tuple[Phase, ...]
    handler: Handler
    doc: str


def initial_state(rank: int) -> StepState:
    return StepState(phase=Phase.INIT, rank=rank)


def decide(state: StepState, event: Event) -> Result:
    """The whole machine. Pure: same inputs, same outputs; raises InvalidTransition."""
    rule = TABLE.get((state.phase, type(event)))
    if rule is None:
        raise InvalidTransition(state.phase, event)
    new, actions = rule.handler(state, event)
    assert new.phase in rule.targets, (state.phase, event, new.phase)
    return new, actions


# --- helpers -----------------------------------------------------------------------------


def _begin_rollback(s: StepState, reason: str, *, propose: bool) -> Result:
    """Enter ROLLBACK_REQ: interrupt the step, make sure the decision is ROLLBACK, tell
    everyone, and count ourselves as heard."""
    actions: list[Action] = [InterruptStep(reason)]
    if propose:
        actions.append(ProposeRollback(s.epoch, s.step, reason))
    actions.append(BroadcastRollbackRequest(s.epoch, s.step, reason))
    s = replace(s, phase=Phase.ROLLBACK_REQ, heard=s.heard | {s.rank}, reason=reason)
    return _maybe_sync(s, tuple(actions))


def _maybe_sync(s: StepState, actions: Sequence[Action]) -> Result:
    """ROLLBACK_REQ -> ROLLBACK_SYNC once every member was heard from or is dead."""
    if s.phase is Phase.ROLLBACK_REQ and s.members <= s.heard | s.dead:
        sync: tuple[Action, ...] = (
            AbortProcessGroup(),
            CancelFutures(),
            ZeroGrads(),
            BroadcastRollbackAck(s.epoch, s.step),
        )
        s = replace(s, phase=Phase.ROLLBACK_SYNC, acked=s.acked | {s.rank})
        return _maybe_heal(s, (*actions, *sync))
    return s, tuple(actions)


def _maybe_heal(s: StepState, actions: Sequence[Action]) -> Result:
    """ROLLBACK_SYNC -> HEALING once every member acked or is dead."""
    if s.phase is Phase.ROLLBACK_SYNC and s.members <= s.acked | s.dead:
        form = FormEpoch(
            after_epoch=s.epoch,
            exclude=s.dead | s.leaving,
            lost_state=s.lost_state,
            rollback=True,
        )
        return replace(s, phase=Phase.HEALING), (*actions, form)
    return s, tuple(actions)


def _note_fault(s: StepState, rank: int, severity: Severity) -> StepState:
    if severity is Severity.FAULT1:
        return replace(s, dead=s.dead | {rank}, faulty=s.faulty | {rank})
    return replace(s, heard=s.heard | {rank})


def _enter_epoch(s: StepState, e: QuorumReady) -> Result:
    s = StepState(
        phase=Phase.HEALING,
        rank=s.rank,
        epoch=e.epoch,
        step=e.step,
        members=e.members,
        lost_state=s.rank in e.needs_state,
        want_drain=s.want_drain,
        joining=e.waiting,
    )
    actions: list[Action] = [ConfigureProcessGroup(e.epoch, e.members)]
    if not e.needs_state:
        return replace(s, phase=Phase.NORMAL), tuple(actions)
    if s.lost_state:
        actions.append(FetchState(e.epoch, e.step))
    elif e.source is None or e.source == s.rank:
        actions.append(SendState(e.epoch, e.step, e.needs_state))
    else:  # a bystander of a heal between the source and the receivers: the step goes on
        return replace(s, phase=Phase.NORMAL), tuple(actions)
    return s, tuple(actions)


# --- handlers ----------------------------------------------------------------------------


def _quorum_ready(s: StepState, e: Event) -> Result:
    assert isinstance(e, QuorumReady)
    if s.rank not in e.members:
        return replace(s, phase=Phase.EXIT), (ExitWorker(f"not a member of epoch {e.epoch}"),)
    return _enter_epoch(s, e)


def _heal_done(s: StepState, e: Event) -> Result:
    assert isinstance(e, HealDone)
    return replace(s, phase=Phase.NORMAL, lost_state=s.lost_state and e.pending, reason=""), ()


def _state_loaded(s: StepState, e: Event) -> Result:
    return replace(s, lost_state=False), ()


def _grads_ready(s: StepState, e: Event) -> Result:
    if s.lost_state:
        # a pending heal (HealDone) not yet loaded: voting now would commit a step on a
        # state this worker does not hold (S4); the caller must feed StateLoaded first
        raise InvalidTransition(s.phase, e)
    vote = CastVote(s.epoch, s.step, s.want_drain, joining=s.joining)
    return replace(s, phase=Phase.PREPARED), (vote,)


def _local_fault_running(s: StepState, e: Event) -> Result:
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


def _local_fault_latched(s: StepState, e: Event) -> Result:
    assert isinstance(e, LocalFault)
    lost = s.lost_state or e.severity is Severity.FAULT1
    return replace(s, lost_state=lost, pending_fault=s.phase is Phase.COMMIT or s.pending_fault), ()


def _local_fault_healing(s: StepState, e: Event) -> Result:
    assert isinstance(e, LocalFault)
    s = replace(
        s,
        lost_state=s.lost_state or e.severity is Severity.FAULT1,
        heard=frozenset(),
        acked=frozenset(),
    )
    return _begin_rollback(s, e.cause, propose=False)


def _peer_fault_normal(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    return _begin_rollback(_note_fault(s, e.rank, e.severity), e.cause, propose=True)


def _peer_fault_prepared(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    s = replace(_note_fault(s, e.rank, e.severity), pending_fault=True)
    return s, (InterruptStep(e.cause), ProposeRollback(s.epoch, s.step, e.cause))


def _peer_fault_collecting(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    s = _note_fault(s, e.rank, e.severity)
    if s.phase is Phase.ROLLBACK_SYNC:
        s = replace(s, acked=s.acked | ({e.rank} if e.rank in s.dead else frozenset()))
        return _maybe_heal(s, ())
    return _maybe_sync(s, ())


def _peer_fault_latched(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    s = _note_fault(s, e.rank, e.severity)
    return replace(
        s, pending_fault=s.pending_fault or s.phase in (Phase.COMMIT, Phase.DRAIN_COMMIT)
    ), ()


def _peer_fault_healing(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    if e.rank not in s.members:
        return s, ()
    s = _note_fault(replace(s, heard=frozenset(), acked=frozenset()), e.rank, e.severity)
    return _begin_rollback(s, e.cause, propose=False)


def _record_ack(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackAcked)
    return replace(s, heard=s.heard | {e.rank}, acked=s.acked | {e.rank}), ()


def _peer_fault_drain_wait(s: StepState, e: Event) -> Result:
    assert isinstance(e, PeerFault)
    return _drain_acked(replace(s, dead=s.dead | {e.rank}), DrainAcked(e.rank))


def _rollback_req_normal(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    return _begin_rollback(
        replace(s, heard=s.heard | {e.rank}), f"rollback requested by rank {e.rank}", propose=True
    )


def _rollback_req_prepared(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    s = replace(s, heard=s.heard | {e.rank}, pending_fault=True)
    reason = f"rollback requested by rank {e.rank}"
    return s, (InterruptStep(reason), ProposeRollback(s.epoch, s.step, reason))


def _rollback_req_collect(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    return _maybe_sync(replace(s, heard=s.heard | {e.rank}), ())


def _rollback_req_latched(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackRequested)
    return replace(s, heard=s.heard | {e.rank}, pending_fault=True), ()


def _rollback_ack(s: StepState, e: Event) -> Result:
    assert isinstance(e, RollbackAcked)
    # An ack implies the sender also requested: it counts for both barriers.
    s = replace(s, heard=s.heard | {e.rank}, acked=s.acked | {e.rank})
    if s.phase is Phase.ROLLBACK_REQ:
        return _maybe_sync(s, ())
    return _maybe_heal(s, ())


def _decision_prepared(s: StepState, e: Event) -> Result:
    assert isinstance(e, Decision)
    if not e.commit:
        s = replace(s, pending_fault=False)
        return _begin_rollback(s, s.reason or "decision: rollback", propose=False)
    phase = Phase.DRAIN_COMMIT if s.want_drain else Phase.COMMIT
    s = replace(s, phase=phase, leaving=s.leaving | (e.leaving - {s.rank}), admit=e.admit)
    return s, (ApplyCommit(s.step),)


def _decision_rollback_only(s: StepState, e: Event) -> Result:
    assert isinstance(e, Decision)
    if e.commit:
        # Without our vote no commit can be decided: the caller mixed up steps or epochs.
        raise InvalidTransition(s.phase, e)
    if s.phase is Phase.NORMAL:
        return _begin_rollback(s, "decision: rollback", propose=False)
    return s, ()


def _commit_applied(s: StepState, e: Event) -> Result:
    s = replace(s, step=s.step + 1, heard=frozenset(), acked=frozenset(), reason="")
    if s.pending_fault or s.dead:
        s = replace(s, pending_fault=False)
        return _begin_rollback(s, "fault after the commit decision", propose=True)
    if s.leaving or s.admit:
        # Every survivor read the same decision (with the same leavers, and whether to
        # admit joiners) from the store: no barrier is needed to agree on re-forming.
        # Joiners are admitted by the formation itself (they registered in the store).
        # A join request latched after this member voted is not enough: the others may
        # not have seen it; it goes with the next vote.
        s = replace(s, phase=Phase.HEALING, dead=s.dead | s.leaving, joining=False, admit=False)
        return s, (FormEpoch(after_epoch=s.epoch, exclude=s.dead, lost_state=s.lost_state),)
    return replace(s, phase=Phase.NORMAL), ()


def _drain_commit_applied(s: StepState, e: Event) -> Result:
    s = replace(s, phase=Phase.DRAIN_WAIT, step=s.step + 1, acked=frozenset({s.rank}))
    actions: tuple[Action, ...] = (BroadcastDrainNotice(s.epoch, s.step - 1, s.reason or "drain"),)
    return _drain_acked(s, DrainAcked(s.rank), actions)


def _drain_acked(s: StepState, e: Event, actions: tuple[Action, ...] = ()) -> Result:
    assert isinstance(e, DrainAcked)
    s = replace(s, acked=s.acked | {e.rank})
    if s.members <= s.acked | s.dead:
        return replace(s, phase=Phase.EXIT), (*actions, ExitWorker("drained"))
    return s, actions


def _want_drain(s: StepState, e: Event) -> Result:
    assert isinstance(e, DrainRequested)
    return replace(s, want_drain=True, reason=e.reason or "drain"), ()


def _drain_noticed(s: StepState, e: Event) -> Result:
    assert isinstance(e, DrainNoticed)
    known = e.rank in s.leaving
    s = replace(s, leaving=s.leaving | {e.rank})
    if known or e.rank not in s.members or s.phase in (Phase.COMMIT, Phase.HEALING):
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


def _drain_noticed_ack_only(s: StepState, e: Event) -> Result:
    assert isinstance(e, DrainNoticed)
    return s, (SendDrainAck(e.rank),)


def _drain_noticed_collect(s: StepState, e: Event) -> Result:
    assert isinstance(e, DrainNoticed)
    s = replace(s, dead=s.dead | {e.rank}, leaving=s.leaving | {e.rank})
    if s.phase is Phase.ROLLBACK_SYNC:
        return _maybe_heal(s, (SendDrainAck(e.rank),))
    nxt, actions = _maybe_sync(s, ())
    return nxt, (SendDrainAck(e.rank), *actions)


def _deadline(s: StepState, e: Event) -> Result:
    silent = s.members - (s.heard if s.phase is Phase.ROLLBACK_REQ else s.acked) - s.dead
    if not silent:
        return s, ()
    s = replace(s, dead=s.dead | silent, faulty=s.faulty | silent)
    nxt, actions = (_maybe_sync if s.phase is Phase.ROLLBACK_REQ else _maybe_heal)(s, ())
    return nxt, (DeclareDead(silent), *actions)


def _join_requested(s: StepState, e: Event) -> Result:
    assert isinstance(e, JoinRequested)
    if e.rank in s.members and e.rank not in s.dead:
        return s, ()  # a member's own (late or duplicate) request: nothing to admit
    return replace(s, joining=True), ()


def _ignore(s: StepState, e: Event) -> Result:
    return s, ()


def _shutdown(s: StepState, e: Event) -> Result:
    assert isinstance(e, Shutdown)
    return replace(s, phase=Phase.EXIT), (ExitWorker(e.reason or "shutdown"),)


def _exit_ignore(s: StepState, e: Event) -> Result:
    return s, ()


# --- the table ---------------------------------------------------------------------------

P = Phase
_COLLECTING = (P.ROLLBACK_REQ, P.ROLLBACK_SYNC)
SAME = None
"""In a row's targets: the source phase itself (an event that is ignored or latched)."""
_ROLLBACK = (P.ROLLBACK_REQ, P.ROLLBACK_SYNC, P.HEALING)
_FROM_REQ = _ROLLBACK
_FROM_SYNC = (P.ROLLBACK_SYNC, P.HEALING)


def _build() -> dict[tuple[Phase, type[Event]], Rule]:
    t: dict[tuple[Phase, type[Event]], Rule] = {}
    running = [p for p in Phase if p is not P.EXIT]

    def row(
        phases: Sequence[Phase],
        event: type[Event],
        targets: Sequence[Phase | None],
        h: Handler,
        doc: str,
    ) -> None:
        for p in phases:
            assert (p, event) not in t, (p, event)
            resolved = tuple(dict.fromkeys(p if x is SAME else x for x in targets))
            t[(p, event)] = Rule(resolved, h, doc)

    # membership and healing
    row(
        [P.INIT, P.HEALING],
        QuorumReady,
        [P.NORMAL, P.HEALING, P.EXIT],
        _quorum_ready,
        "quorum ready: configure the PG; heal if anyone needs state",
    )
    row(
        [P.HEALING],
        HealDone,
        [P.NORMAL],
        _heal_done,
        "state transferred (with pending: all but the optimizer state)",
    )
    row([P.NORMAL], StateLoaded, [P.NORMAL], _state_loaded, "the rest of a pending heal loaded")
    # the step
    row([P.NORMAL], GradsReady, [P.PREPARED], _grads_ready, "compute grads: vote yes")
    row(
        [P.PREPARED],
        Decision,
        [P.COMMIT, P.DRAIN_COMMIT, *_ROLLBACK],
        _decision_prepared,
        "all peers vote yes -> commit (drain if wanted); else rollback",
    )
    row([P.NORMAL], Decision, _ROLLBACK, _decision_rollback_only, "a rollback decided by a peer")
    row([*_ROLLBACK], Decision, [SAME], _decision_rollback_only, "rollback already known")
    row(
        [P.COMMIT],
        CommitApplied,
        [P.NORMAL, *_ROLLBACK],
        _commit_applied,
        "step++ (a latched fault or a leaver re-forms the epoch)",
    )
    # local faults
    row([P.NORMAL], LocalFault, _ROLLBACK, _local_fault_running, "local error: propose rollback")
    row(
        [P.PREPARED],
        LocalFault,
        [P.PREPARED],
        _local_fault_running,
        "local error after our vote: propose rollback, the store decides",
    )
    row(
        [P.INIT, *_COLLECTING, P.COMMIT, P.DRAIN_COMMIT, P.DRAIN_WAIT],
        LocalFault,
        [SAME],
        _local_fault_latched,
        "latched (Fault1 marks own state lost)",
    )
    row(
        [P.HEALING],
        LocalFault,
        _ROLLBACK,
        _local_fault_healing,
        "fault during healing: roll back again",
    )
    # peer faults
    row([P.NORMAL], PeerFault, _ROLLBACK, _peer_fault_normal, "remote error: propose rollback")
    row(
        [P.PREPARED],
        PeerFault,
        [P.PREPARED],
        _peer_fault_prepared,
        "remote error after our vote: propose rollback, the store decides",
    )
    row(
        [P.ROLLBACK_REQ],
        PeerFault,
        _FROM_REQ,
        _peer_fault_collecting,
        "a dead member counts as heard",
    )
    row(
        [P.ROLLBACK_SYNC],
        PeerFault,
        _FROM_SYNC,
        _peer_fault_collecting,
        "a dead member counts as heard",
    )
    row(
        [P.INIT, P.COMMIT, P.DRAIN_COMMIT],
        PeerFault,
        [SAME],
        _peer_fault_latched,
        "latched (handled after the commit is applied)",
    )
    row(
        [P.HEALING],
        PeerFault,
        _ROLLBACK,
        _peer_fault_healing,
        "fault during healing: roll back again",
    )
    row(
        [P.DRAIN_WAIT],
        PeerFault,
        [P.DRAIN_WAIT, P.EXIT],
        _peer_fault_drain_wait,
        "a dead member will not ack",
    )
    # the rollback barriers
    row([P.NORMAL], RollbackRequested, _ROLLBACK, _rollback_req_normal, "rollback_req from a peer")
    row(
        [P.PREPARED],
        RollbackRequested,
        [P.PREPARED],
        _rollback_req_prepared,
        "rollback_req after our vote: the store decides",
    )
    row([P.ROLLBACK_REQ], RollbackRequested, _ROLLBACK, _rollback_req_collect, "collect requests")
    row(
        [P.COMMIT, P.DRAIN_COMMIT],
        RollbackRequested,
        [SAME],
        _rollback_req_latched,
        "peer faulted after the decision: next step rolls back",
    )
    row(
        [P.ROLLBACK_SYNC, P.HEALING, P.INIT, P.DRAIN_WAIT],
        RollbackRequested,
        [SAME],
        _ignore,
        "already past it",
    )
    row([P.ROLLBACK_REQ], RollbackAcked, _FROM_REQ, _rollback_ack, "collect acks")
    row([P.ROLLBACK_SYNC], RollbackAcked, _FROM_SYNC, _rollback_ack, "collect acks")
    row([P.HEALING, P.NORMAL, P.INIT, P.DRAIN_WAIT], RollbackAcked, [SAME], _ignore, "late ack")
    row(
        [P.PREPARED, P.COMMIT, P.DRAIN_COMMIT],
        RollbackAcked,
        [SAME],
        _record_ack,
        "early ack: recorded",
    )
    row([P.ROLLBACK_REQ], Deadline, _FROM_REQ, _deadline, "silent members are declared dead")
    row([P.ROLLBACK_SYNC], Deadline, _FROM_SYNC, _deadline, "silent members are declared dead")
    row([p for p in running if p not in _COLLECTING], Deadline, [SAME], _ignore, "stale timer")
    # drain
    row(running, DrainRequested, [SAME], _want_drain, "want_drain (latched)")
    row(
        [P.DRAIN_COMMIT],
        CommitApplied,
        [P.DRAIN_WAIT, P.EXIT],
        _drain_commit_applied,
        "broadcast DRAIN_NOTICE",
    )
    row([P.DRAIN_WAIT], DrainAcked, [P.DRAIN_WAIT, P.EXIT], _drain_acked, "all DRAIN_ACK -> exit")
    row(
        [p for p in running if p is not P.DRAIN_WAIT], DrainAcked, [SAME], _ignore, "late drain ack"
    )
    row(
        [P.NORMAL, P.PREPARED, P.COMMIT, P.HEALING],
        DrainNoticed,
        [SAME, *_ROLLBACK],
        _drain_noticed,
        "a member left: ack, drop it from the next epoch",
    )
    row(
        [P.ROLLBACK_REQ],
        DrainNoticed,
        _FROM_REQ,
        _drain_noticed_collect,
        "a drained member counts as dead",
    )
    row(
        [P.ROLLBACK_SYNC],
        DrainNoticed,
        _FROM_SYNC,
        _drain_noticed_collect,
        "a drained member counts as dead",
    )
    row(
        [P.INIT, P.DRAIN_COMMIT, P.DRAIN_WAIT],
        DrainNoticed,
        [SAME],
        _drain_noticed_ack_only,
        "ack; nothing to re-form",
    )
    # joins
    row(
        [P.NORMAL, P.PREPARED, P.COMMIT],
        JoinRequested,
        [SAME],
        _join_requested,
        "a worker waits to join: re-form after the next commit",
    )
    row(
        [P.INIT, *_COLLECTING, P.HEALING, P.DRAIN_COMMIT, P.DRAIN_WAIT],
        JoinRequested,
        [SAME],
        _ignore,
        "a formation is under way or not ours to run (joiners re-announce)",
    )
    # stopping
    row(running, Shutdown, [P.EXIT], _shutdown, "stop")
    for ev in (
        QuorumReady,
        LocalFault,
        PeerFault,
        RollbackRequested,
        RollbackAcked,
        Decision,
        DrainNoticed,
        DrainAcked,
        Deadline,
        Shutdown,
        DrainRequested,
        JoinRequested,
    ):
        row([P.EXIT], ev, [P.EXIT], _exit_ignore, "exited: ignore")
    return t


TABLE: dict[tuple[Phase, type[Event]], Rule] = _build()
