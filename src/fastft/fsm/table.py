"""The step state machine: ``decide(state, event) -> (state, actions)``.

The transition table :data:`TABLE` is data: for every (phase, event type) it names the
phases the transition may lead to and a pure handler that computes the new state and the
actions. A pair that is not in the table raises :class:`InvalidTransition` naming both.
``docs/fsm.md`` is generated from this table (``python -m fastft.fsm``).

Protocol summary (DESIGN "The state machine"): a step runs NORMAL -> PREPARED (grads ready,
vote yes) -> COMMIT (decision) -> NORMAL(step + 1). Any fault before the decision makes a
member propose ROLLBACK with a compare-and-set in the store; the store keeps exactly one
decision per (epoch, step). A member that knows of a fault and is not waiting for a decision
rolls back at once (the process group abandoned, futures cancelled, gradients dropped) and
goes to HEALING, where the next epoch is formed without the dead (the formation's arrivals
are the rollback's barrier: DESIGN's ROLLBACK_REQ and ROLLBACK_SYNC, docs/architecture.md)
and state is sent to Fault1 members only; then NORMAL at the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import fastft.fsm.handlers as h
from fastft.fsm.contract import (
    CommitApplied,
    Deadline,
    Decision,
    DrainAcked,
    DrainNoticed,
    DrainRequested,
    Event,
    GradsReady,
    HealDone,
    InvalidTransition,
    JoinRequested,
    LocalFault,
    PeerFault,
    Phase,
    QuorumReady,
    RollbackRequested,
    Shutdown,
    StateLoaded,
    StepState,
)

__all__ = ["decide", "initial_state", "Rule", "TABLE"]

from fastft.fsm.handlers import Handler, Result


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


# --- the table ---------------------------------------------------------------------------

P = Phase
SAME = None
"""In a row's targets: the source phase itself (an event that is ignored or latched)."""
_ROLLBACK = (P.HEALING,)
"""Where a rollback leads: the next epoch's formation."""


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
        [P.NORMAL, P.HEALING, P.INIT, P.EXIT, *_ROLLBACK],
        h.quorum_ready,
        "quorum ready: configure the PG; heal if anyone needs state (left out while it "
        "heals itself: rejoin as a joiner; a fault while it formed: roll it back)",
    )
    row(
        [P.HEALING],
        HealDone,
        [P.NORMAL],
        h.heal_done,
        "state transferred (with pending: all but the optimizer state)",
    )
    row([P.NORMAL], StateLoaded, [P.NORMAL], h.state_loaded, "the rest of a pending heal loaded")
    # the step
    row([P.NORMAL], GradsReady, [P.PREPARED], h.grads_ready, "compute grads: vote yes")
    row(
        [P.PREPARED],
        Decision,
        [P.COMMIT, P.DRAIN_COMMIT, *_ROLLBACK],
        h.decision_prepared,
        "all peers vote yes -> commit (drain if wanted); else rollback",
    )
    row([P.NORMAL], Decision, _ROLLBACK, h.decision_rollback_only, "a rollback decided by a peer")
    row([*_ROLLBACK], Decision, [SAME], h.decision_rollback_only, "rollback already known")
    row(
        [P.COMMIT],
        CommitApplied,
        [P.NORMAL, *_ROLLBACK],
        h.commit_applied,
        "step++ (a latched fault or a leaver re-forms the epoch)",
    )
    # local faults
    row([P.NORMAL], LocalFault, _ROLLBACK, h.local_fault_running, "local error: propose rollback")
    row(
        [P.PREPARED],
        LocalFault,
        [P.PREPARED],
        h.local_fault_running,
        "local error after our vote: propose rollback, the store decides",
    )
    row(
        [P.INIT, P.COMMIT, P.DRAIN_COMMIT, P.DRAIN_WAIT],
        LocalFault,
        [SAME],
        h.local_fault_latched,
        "latched (Fault1 marks own state lost)",
    )
    row(
        [P.HEALING],
        LocalFault,
        _ROLLBACK,
        h.local_fault_healing,
        "fault during healing: roll back again (forming: the new epoch rolls back)",
    )
    # peer faults
    row([P.NORMAL], PeerFault, _ROLLBACK, h.peer_fault_normal, "remote error: propose rollback")
    row(
        [P.PREPARED],
        PeerFault,
        [P.PREPARED],
        h.peer_fault_prepared,
        "remote error after our vote: propose rollback, the store decides",
    )
    row(
        [P.INIT, P.COMMIT, P.DRAIN_COMMIT],
        PeerFault,
        [SAME],
        h.peer_fault_latched,
        "latched (handled after the commit is applied)",
    )
    row(
        [P.HEALING],
        PeerFault,
        _ROLLBACK,
        h.peer_fault_healing,
        "fault during healing: roll back again",
    )
    row(
        [P.DRAIN_WAIT],
        PeerFault,
        [P.DRAIN_WAIT, P.EXIT, P.HEALING],
        h.peer_fault_drain_wait,
        "a dead member will not ack (the last holder of the state re-forms instead)",
    )
    # rollback requests (a formation's reminder to the members it misses)
    row([P.NORMAL], RollbackRequested, _ROLLBACK, h.rollback_req_normal, "rollback_req from a peer")
    row(
        [P.PREPARED],
        RollbackRequested,
        [P.PREPARED],
        h.rollback_req_prepared,
        "rollback_req after our vote: the store decides",
    )
    row(
        [P.COMMIT, P.DRAIN_COMMIT],
        RollbackRequested,
        [SAME],
        h.rollback_req_latched,
        "peer faulted after the decision: next step rolls back",
    )
    row(
        [P.HEALING],
        RollbackRequested,
        [SAME, *_ROLLBACK],
        h.rollback_req_healing,
        "forming: already past it; else a rollback of the new epoch",
    )
    row(
        [P.INIT, P.DRAIN_WAIT],
        RollbackRequested,
        [SAME],
        h.ignore,
        "already past it",
    )
    row(
        [P.DRAIN_WAIT],
        Deadline,
        [P.EXIT],
        h.drain_deadline,
        "acks missing past the timeout: leave (the decision named the leaver)",
    )
    row(
        [p for p in running if p is not P.DRAIN_WAIT],
        Deadline,
        [SAME],
        h.ignore,
        "stale timer",
    )
    # drain
    row(running, DrainRequested, [SAME], h.want_drain, "want_drain (latched)")
    row(
        [P.DRAIN_COMMIT],
        CommitApplied,
        [P.DRAIN_WAIT, P.EXIT],
        h.drain_commit_applied,
        "broadcast DRAIN_NOTICE",
    )
    row([P.DRAIN_WAIT], DrainAcked, [P.DRAIN_WAIT, P.EXIT], h.drain_acked, "all DRAIN_ACK -> exit")
    row(
        [p for p in running if p is not P.DRAIN_WAIT],
        DrainAcked,
        [SAME],
        h.ignore,
        "late drain ack",
    )
    row(
        [P.NORMAL, P.PREPARED, P.COMMIT, P.HEALING],
        DrainNoticed,
        [SAME, *_ROLLBACK],
        h.drain_noticed,
        "a member left: ack, drop it from the next epoch",
    )
    row(
        [P.INIT, P.DRAIN_COMMIT, P.DRAIN_WAIT],
        DrainNoticed,
        [SAME],
        h.drain_noticed_ack_only,
        "ack; nothing to re-form",
    )
    # joins
    row(
        [P.NORMAL, P.PREPARED, P.COMMIT],
        JoinRequested,
        [SAME],
        h.join_requested,
        "a worker waits to join: re-form after the next commit",
    )
    row(
        [P.INIT, P.HEALING, P.DRAIN_COMMIT, P.DRAIN_WAIT],
        JoinRequested,
        [SAME],
        h.ignore,
        "a formation is under way or not ours to run (joiners re-announce)",
    )
    # stopping
    row(running, Shutdown, [P.EXIT], h.shutdown, "stop")
    for ev in (
        QuorumReady,
        LocalFault,
        PeerFault,
        RollbackRequested,
        Decision,
        DrainNoticed,
        DrainAcked,
        Deadline,
        Shutdown,
        DrainRequested,
        JoinRequested,
    ):
        row([P.EXIT], ev, [P.EXIT], h.exit_ignore, "exited: ignore")
    return t


TABLE: dict[tuple[Phase, type[Event]], Rule] = _build()
