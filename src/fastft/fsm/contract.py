"""Contract of the step state machine: phases, the state value, events, actions, errors.

Everything here is a frozen value. The machine itself (``fastft.fsm.table``) is a pure
function ``decide(state, event) -> (state, actions)``; an executor in the runtime performs
the actions (abort a process group, cast a vote in the store, broadcast on the bus).
Time enters only through events (``Deadline.now``); nothing here reads a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fastft.errors import FastFTError
from fastft.protocol.messages import Severity

__all__ = [
    "Phase",
    "StepState",
    "Event",
    "QuorumReady",
    "GradsReady",
    "LocalFault",
    "PeerFault",
    "RollbackRequested",
    "Decision",
    "CommitApplied",
    "HealDone",
    "StateLoaded",
    "DrainRequested",
    "DrainNoticed",
    "DrainAcked",
    "Deadline",
    "Shutdown",
    "JoinRequested",
    "Action",
    "ConfigureProcessGroup",
    "CastVote",
    "ProposeRollback",
    "InterruptStep",
    "AbortProcessGroup",
    "CancelFutures",
    "ZeroGrads",
    "ApplyCommit",
    "FormEpoch",
    "FetchState",
    "SendState",
    "BroadcastDrainNotice",
    "SendDrainAck",
    "ReportFault",
    "DeclareDead",
    "ExitWorker",
    "InvalidTransition",
]


class Phase(enum.Enum):
    """Phases of one worker's step (the seed's second diagram)."""

    INIT = "INIT"
    NORMAL = "NORMAL"
    PREPARED = "PREPARED"
    COMMIT = "COMMIT"
    HEALING = "HEALING"
    DRAIN_COMMIT = "DRAIN_COMMIT"
    DRAIN_WAIT = "DRAIN_WAIT"
    EXIT = "EXIT"


@dataclass(frozen=True)
class StepState:
    """Everything the machine knows about one worker's view of the job.

    ``acked``: members that acknowledged this worker's drain notice (DRAIN_WAIT); ``dead``: members known gone in this
    epoch (died, hung past the deadline, drained; the next epoch heals their
    replacements); ``lost_state``: this worker is Fault1 itself;
    ``pending_fault``: a fault arrived after the commit decision and is handled after the
    commit is applied; ``leaving``: members that announced a drain with their vote; ``joining``: a worker
    waits to be admitted (latched from its JoinRequest, sent with the next vote);
    ``admit``: the decision of this step says to re-form the epoch after the commit;
    ``forming``: in HEALING, the next epoch is being formed (no QuorumReady yet);
    ``refault``: this worker's own fault came while it formed the next epoch: it rolls
    that epoch back as it begins, and tells its peers again (:class:`ReportFault`).
    """

    phase: Phase
    rank: int
    epoch: int = 0
    step: int = 0
    members: frozenset[int] = frozenset()
    acked: frozenset[int] = frozenset()
    dead: frozenset[int] = frozenset()
    leaving: frozenset[int] = frozenset()
    lost_state: bool = False
    want_drain: bool = False
    pending_fault: bool = False
    joining: bool = False
    admit: bool = False
    forming: bool = False
    refault: bool = False
    reason: str = ""

    @property
    def live(self) -> frozenset[int]:
        """Members not known dead."""
        return self.members - self.dead

    @property
    def may_end_the_job(self) -> bool:
        """A member whose script ends now ends the job (joiners waiting to be admitted need
        not wait any more): its last step committed (NORMAL, or HEALING after a fault that
        came once the commit was decided). (A drained worker's end is not its script's.)"""
        return self.phase in (Phase.NORMAL, Phase.HEALING)


# --- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """Base of every event."""


@dataclass(frozen=True)
class QuorumReady(Event):
    """A new epoch was agreed: its members, the committed ``step`` it resumes from, and the
    members that must receive state (Fault1 members and fresh joiners)."""

    epoch: int
    members: frozenset[int]
    step: int
    needs_state: frozenset[int] = frozenset()
    waiting: bool = False
    """Workers waiting to join were left out of this epoch (an elastic world's rollback):
    admit them after the next commit."""
    source: int | None = None
    """The member that sends the state to ``needs_state``. Set: the heal runs between it
    and them only, and every other member goes on at once. None: every member that has
    the state takes part in sending it (one collective over the whole epoch)."""


@dataclass(frozen=True)
class GradsReady(Event):
    """Forward, backward and the gradient sync of the current step finished locally.

    ``agreed``: the step's decision collective completed here with every member's flags
    clean (each voted yes, none drains or saw a joiner): the step commits without the
    store (DESIGN S2, as revised in docs/architecture.md "The fault-free decision")."""

    agreed: bool = False
    confirm: bool = False
    """With ``agreed``: the collective completed so long after this member's previous
    contact with every member that they may have left the epoch meanwhile (a Gloo
    operation they abandoned completes later, when a cut mends): the commit is confirmed
    in the store first (:class:`CastVote`)."""


@dataclass(frozen=True)
class LocalFault(Event):
    """This worker failed inside the step (exception; Fault1 if its state is lost)."""

    severity: Severity
    cause: str


@dataclass(frozen=True)
class PeerFault(Event):
    """A peer failed: its own fault report, a process-death notice from its agent, or a
    hang notice. Fault1 means the peer is gone or its state is lost."""

    rank: int
    severity: Severity
    cause: str


@dataclass(frozen=True)
class RollbackRequested(Event):
    """A member asked to roll back the current step (a formation of the next epoch that
    still misses members reminds them: :mod:`fastft.runtime.engine.coordinator`)."""

    rank: int


@dataclass(frozen=True)
class Decision(Event):
    """The store's one decision for (epoch, step): commit or roll back. ``leaving`` are the
    members that voted yes with a drain request."""

    commit: bool
    leaving: frozenset[int] = frozenset()
    admit: bool = False
    """A member voted with a join request latched: after this commit every member re-forms
    the epoch to admit the waiting workers (agreed, because it is part of the decision)."""


@dataclass(frozen=True)
class CommitApplied(Event):
    """The optimizer update of the committed step was applied locally."""


@dataclass(frozen=True)
class HealDone(Event):
    """State transfer of the new epoch finished (sent or received), or, with ``pending``,
    all of it but the optimizer state, which a receiver takes while its step runs: it
    keeps ``lost_state`` (a fault meanwhile heals it again) until :class:`StateLoaded`,
    and must not vote before."""

    pending: bool = False


@dataclass(frozen=True)
class StateLoaded(Event):
    """The rest of a pending heal (:class:`HealDone`) arrived and was loaded."""


@dataclass(frozen=True)
class DrainRequested(Event):
    """This worker should leave after its next commit (preemption notice, maintenance)."""

    reason: str = ""


@dataclass(frozen=True)
class DrainNoticed(Event):
    """A member announced that it committed ``step`` and left (-1: not said)."""

    rank: int
    step: int = -1


@dataclass(frozen=True)
class DrainAcked(Event):
    """A member acknowledged this worker's drain notice."""

    rank: int


@dataclass(frozen=True)
class JoinRequested(Event):
    """A started or restarted worker (``rank``) waits to be admitted to the next epoch."""

    rank: int


@dataclass(frozen=True)
class Deadline(Event):
    """The timeout of a drain's acknowledgements expired at ``now`` (seconds, monotonic):
    the leaver leaves. (A rollback has no barrier of its own: the next epoch's formation
    is it, and its closer declares the members that never arrived dead.)"""

    now: float


@dataclass(frozen=True)
class Shutdown(Event):
    """Stop now (the job ends or the worker is told to exit)."""

    reason: str = ""


# --- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """Base of every action."""


@dataclass(frozen=True)
class ConfigureProcessGroup(Action):
    """Build a new data-plane process group for ``epoch`` (its members: the epoch's view)."""

    epoch: int


@dataclass(frozen=True)
class CastVote(Action):
    """Vote yes for committing (epoch, step) in the store."""

    epoch: int
    step: int
    want_drain: bool = False
    joining: bool = False
    """A worker waits to join: ask for the epoch to be re-formed after this step."""
    agreed: bool = False
    """Decided already, by the step's collective (:class:`GradsReady`): commit; no store
    vote."""
    confirm: bool = False
    """With ``agreed``: compare-and-set the commit as the step's decision first; a
    rollback a member proposed already holds instead (:class:`GradsReady`)."""


@dataclass(frozen=True)
class ProposeRollback(Action):
    """Compare-and-set ROLLBACK as the decision of (epoch, step); a no-op if decided."""

    epoch: int
    step: int
    reason: str


@dataclass(frozen=True)
class InterruptStep(Action):
    """Interrupt the main thread's step (futures, collectives, signal)."""

    reason: str


@dataclass(frozen=True)
class AbortProcessGroup(Action):
    """Abandon the epoch's process group; it is never reused."""


@dataclass(frozen=True)
class CancelFutures(Action):
    """Fail every pending future of the step."""


@dataclass(frozen=True)
class ZeroGrads(Action):
    """Drop the step's gradients."""


@dataclass(frozen=True)
class ApplyCommit(Action):
    """Apply the optimizer update of ``step``."""

    step: int


@dataclass(frozen=True)
class FormEpoch(Action):
    """Agree on the next epoch without ``exclude``; ``lost_state`` asks for a heal;
    ``rollback``: formed after a rolled-back step (not to admit or drop members at a step
    boundary)."""

    exclude: frozenset[int]
    lost_state: bool
    rollback: bool = False


@dataclass(frozen=True)
class FetchState(Action):
    """Receive the committed state of ``step`` from a live member of ``epoch``."""

    epoch: int
    step: int


@dataclass(frozen=True)
class SendState(Action):
    """Send (or take part in sending) the committed state of ``step`` to the members of
    ``epoch`` that need it (the epoch's view names them)."""

    epoch: int
    step: int


@dataclass(frozen=True)
class BroadcastDrainNotice(Action):
    epoch: int
    step: int
    reason: str


@dataclass(frozen=True)
class SendDrainAck(Action):
    rank: int


@dataclass(frozen=True)
class ReportFault(Action):
    """Tell every peer of this worker's own transient fault again (a Fault2 on the bus),
    as a fault of ``epoch``: it came while that epoch was formed (``StepState.refault``)."""

    epoch: int
    cause: str


@dataclass(frozen=True)
class DeclareDead(Action):
    """Members that never arrived at a formation within its deadline: report them (the
    agent kills and restarts them). Asked by the formation's closer, not the machine."""

    ranks: frozenset[int]


@dataclass(frozen=True)
class ExitWorker(Action):
    reason: str


class InvalidTransition(FastFTError, RuntimeError):
    """An event that has no transition in the current phase: a bug in the caller."""

    def __init__(self, phase: Phase, event: Event) -> None:
        super().__init__(f"no transition for event {type(event).__name__} in phase {phase.name}")
        self.phase = phase
        self.event = event
