"""The main thread's decisions around the store, written once: what a vote, a decision, a
formation, a drain during one and an adopted view ask of the member. Pure: each is a
function from a frozen view of the member (its state, its dead, the view) to a plan;
:class:`~fastft.runtime.engine.membership.Membership` (a worker) and
:class:`~fastft.sim.waits.Waits` (the simulator) only carry the plans out, each with its
own I/O (issue 63). The formation's own rules (who is admitted, who heals, who sends)
are :mod:`fastft.runtime.engine.formation`'s; a survivor's rounds return
:class:`~fastft.runtime.engine.survivors.Round`."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from fastft.fsm import CastVote, Decision, FormEpoch, QuorumReady, StepState
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.decisions import parse_commit
from fastft.runtime.engine.formation import others_hold_state
from fastft.runtime.groups.hsdp import whole_groups

__all__ = [
    "Decided",
    "Drain",
    "Form",
    "Recover",
    "confirms",
    "decided",
    "drain",
    "form",
    "holder_leaves",
    "joiner_leaves",
    "needs_joiners",
    "outsider",
    "recover",
    "records",
    "vote_joining",
    "voted",
]


# --- the vote and its decision ------------------------------------------------------------
def voted(a: CastVote) -> Decision | None:
    """The decision a vote carries already: a step decided by its collective commits with
    no store request; None: the store decides (or confirms: ``a.confirm``)."""
    return Decision(commit=True) if a.agreed and not a.confirm else None


def confirms(a: CastVote) -> bool:
    """Whether a step decided by its collective confirms its commit in the store first (it
    completed late: :class:`~fastft.fsm.GradsReady`), instead of a vote."""
    return a.agreed and a.confirm


def vote_joining(a: CastVote, k: int, joiners: Mapping[int, int] | None) -> bool:
    """Whether the vote asks to admit waiting workers: with shard groups (``k`` > 1), only
    once every member of a restarted group registered (``joiners``: rank -> incarnation,
    read only when :func:`needs_joiners` says so)."""
    if not a.joining or k <= 1:
        return a.joining
    return bool(whole_groups(joiners or {}, k))


def needs_joiners(a: CastVote, k: int) -> bool:
    """Whether :func:`vote_joining` needs the registered joiners read."""
    return a.joining and k > 1


@dataclass(frozen=True)
class Decided:
    """What a decision read from the store asks: ``decision`` fed to the machine;
    ``forget``: the step whose keys this member deletes (the first member, after a commit:
    every member has read the previous step's decision by now); ``quiet``: the fault-free
    commit (logged with the commit's line, not as an event)."""

    decision: Decision
    forget: int | None
    quiet: bool


def decided(view: EpochView | None, rank: int, step: int, got: str) -> Decided:
    parsed = parse_commit(got)
    admit, leaving = parsed if parsed is not None else (False, frozenset[int]())
    commit = parsed is not None
    first = view is not None and view.index(rank) == 0
    return Decided(
        Decision(commit=commit, admit=admit, leaving=leaving),
        forget=step - 1 if commit and first and step > 0 else None,
        quiet=commit and not admit and not leaving,
    )


def records(view: EpochView | None, rank: int) -> bool:
    """Whether this member records each applied step (the first member of the view: a
    total loss then says which step was the last applied)."""
    return view is not None and view.index(rank) == 0


# --- the formation ------------------------------------------------------------------------
@dataclass(frozen=True)
class Form:
    """A survivor's part in the next epoch: the ranks it leaves out, whether registered
    joiners are admitted now, whether it holds the committed state, and the verified step
    it holds (``lost``: the one it goes back to; :class:`.formation.Arrival`)."""

    exclude: frozenset[int]
    admit: bool
    holds: bool
    rewind: int | None


def form(
    a: FormEpoch,
    prev: EpochView,
    me: Member,
    dead: Collection[Member],
    s: StepState,
    *,
    suspect: bool,
    elastic: bool,
    verified: int | None,
    wanted: int | None,
) -> Form:
    """``a`` asked for the next epoch after ``prev``; ``verified``/``wanted``: the verified
    step this member holds and the one it goes back to (a repair's)."""
    exclude = a.exclude | frozenset(m.rank for m in prev.members if m in dead)
    # what it holds is the committed state: not lost, not suspect, and healed if its
    # epoch began by healing it (a member commits only once it holds the state)
    healed = me.rank not in prev.needs_state or s.step > prev.step
    return Form(
        exclude=exclude,
        # elastic: the retry goes on without workers still to heal (admitted after the
        # next commit); a fixed world cannot step without them
        admit=not (a.rollback and elastic),
        holds=healed and not a.lost_state and not suspect,
        rewind=wanted if a.lost_state else verified,
    )


class Drain(enum.Enum):
    """A member asked to drain while its epoch re-forms."""

    NONE = "not asked"
    LEAVE = "another live member holds the committed state: it leaves now"
    LEAVE_WRITING = "as LEAVE; it holds the state too: with --checkpoint-dir it writes it first"
    HOLD = "the last holder of the state, whose own is not whole: it stays and heals"
    LAST = "the last holder: it stays and heals the others, unless holder_leaves()"

    @property
    def leaves(self) -> bool:
        return self in (Drain.LEAVE, Drain.LEAVE_WRITING)


def drain(
    prev: EpochView,
    gone: frozenset[int],
    me: Member,
    dead: Collection[Member],
    s: StepState,
    holds: bool,
) -> Drain:
    """Whether a member asked to drain leaves its formation: at once if another live member
    not ``gone`` (leaving the epoch) holds the committed state (it has no step in flight;
    peers that count on it see an exit); the last holder stays
    (:func:`~fastft.runtime.engine.formation.others_hold_state`), unless
    :func:`holder_leaves`. ``holds``: :attr:`Form.holds`."""
    if not s.want_drain:
        return Drain.NONE
    if others_hold_state(prev, me, dead, s.step, gone | s.leaving):
        return Drain.LEAVE_WRITING if holds else Drain.LEAVE
    return Drain.LAST if holds else Drain.HOLD


def holder_leaves(joiners: bool) -> bool:
    """Whether the last holder (:attr:`Drain.LAST`) leaves too, once a checkpoint holds its
    state (written now if need be; it stays if none can): when nobody is to be healed (no
    ``joiners`` registered: the whole job drains, a preemption). It waited out the drain's
    grace and was stopped otherwise, the agent's line untrue."""
    return not joiners


def joiner_leaves(s: StepState) -> bool:
    """A worker asked to drain while it waits to join leaves now, not after the agent's
    grace (30 s, found by the elastic chaos soak): it holds nothing the job needs (no
    epoch, no committed state of its own)."""
    return s.want_drain


def outsider(view: EpochView, me: Member) -> QuorumReady | None:
    """A closed view that does not list this life: the machine learns it was left out
    (it joins as a new worker); None: it adopts the view."""
    if view.has(me.rank, me.incarnation):
        return None
    return QuorumReady(view.epoch, view.ranks, view.step, view.needs_state)


# --- the adopted view's recovery ----------------------------------------------------------
class Recover(enum.Enum):
    """What an adopted view asks of the member's state before it goes on."""

    NONE = "the view's source or this member holds the state"
    REWIND = "load this member's verified state of view.restore (a replica mismatch's repair)"
    RESTORE = "load the checkpoint of view.restore (a resume, or every holder lost)"
    FRESH_START = "every holder lost: start again from step 0 from a fresh member's state"
    FRESH_RESTART = "every holder lost, no fresh member: restart this worker as one"
    STATE_LOST = "every holder lost, nothing restores it: the job cannot go on"


def recover(view: EpochView, allow_fresh_start: bool) -> Recover:
    """:attr:`EpochView.restore`, :attr:`~EpochView.lost` and :attr:`~EpochView.fatal`
    read once; ``allow_fresh_start``: ``--allow-fresh-start``."""
    if view.restore is not None:
        return Recover.REWIND if view.rewind else Recover.RESTORE
    if view.lost is None:
        return Recover.NONE
    if not view.fatal:  # (a fresh start that --allow-fresh-start allowed)
        return Recover.FRESH_START
    return Recover.FRESH_RESTART if allow_fresh_start else Recover.STATE_LOST
