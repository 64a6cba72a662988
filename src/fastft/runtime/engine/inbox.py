"""The worker's inbox: a bus message becomes state-machine events. Pure.

:func:`route` returns what the executor does with a message: the events it feeds, a life
it now knows dead, and the record it logs. It reads nothing and sends nothing; whether the
job finished (a store read) is asked by the executor before, only for a clean exit.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from fastft.fsm import (
    DrainAcked,
    DrainNoticed,
    DrainRequested,
    Event,
    JoinRequested,
    LocalFault,
    PeerFault,
    RollbackRequested,
)
from fastft.protocol import (
    DrainAck,
    DrainNotice,
    DrainRequest,
    Fault,
    JoinRequest,
    Message,
    RollbackRequest,
    Severity,
)
from fastft.protocol.faults import FaultReport, fault_of
from fastft.runtime.contract import EpochView, Member

__all__ = ["EARLY_KEPT", "Routed", "repeats_logged", "route"]


@dataclass(frozen=True)
class Routed:
    """``events``: feed them, in order; ``dead``: add this life to the dead set;
    ``record``: (event name, fields) for the event log; ``ack_drain``: send this leaver
    its drain ack (outside the state machine: it is no member of this worker's epoch);
    ``early``: a rollback message of an epoch this worker has not adopted yet (a peer
    adopted it first and rolls it back): keep it, and route it again once this worker
    adopts a view (:data:`EARLY_KEPT` at most)."""

    events: tuple[Event, ...] = ()
    dead: Member | None = None
    record: tuple[str, dict[str, Any]] | None = None
    ack_drain: int | None = None
    early: bool = False
    job_done: bool = False
    """A member finished the job (it exited cleanly after the last step)."""
    alive: bool = False
    """Answer a joiner's request with a :class:`~fastft.protocol.Heartbeat`: this epoch is
    alive (its members may be busy, a step compiling), so the joiner waits to be admitted
    and never forms a world of its own (issue 60, case 8)."""


ALIVE_REPLIERS = 3
"""The members of an epoch (its first, by place) that answer a joiner's request: one
answer is enough, and N would flood the bus at every joiner's announcement."""


NOTHING = Routed()


def route(
    m: Message,
    *,
    me: Member,
    view: EpochView | None,
    epoch: int,
    step: int,
    dead: Set[Member],
    finished: bool = False,
    leaving: Set[int] = frozenset(),
    world_size: int | None = None,
) -> Routed:
    """What message ``m`` means to worker ``me`` in ``view`` (None before its first epoch)
    at ``epoch``/``step``, knowing the lives in ``dead``. ``finished``: a member marked
    the job finished (only asked for a clean exit: it then ends the job, not a fault)."""
    if _early(m, me, epoch):
        return Routed(early=True)
    r = fault_of(m)
    if r is not None:
        return _fault(m, r, me, view, epoch, step, dead, finished, leaving)
    if isinstance(m, DrainRequest):  # (latched until the next commit, even before one)
        if m.target_rank != me.rank:
            return NOTHING
        why = m.reason or f"drain requested by {m.role.name.lower()}"
        return Routed(events=(DrainRequested(why[:200]),), record=("drain_requested", {"why": why}))
    return _control(m, me, view, epoch, dead, world_size)


def _fault(
    m: Message,
    r: FaultReport,
    me: Member,
    view: EpochView | None,
    epoch: int,
    step: int,
    dead: Set[Member],
    finished: bool,
    leaving: Set[int],
) -> Routed:
    """:func:`route` of a message that reports a fault or an exit (``r``: what it says of
    whom): a peer's end of the job, a drained peer's exit, a report of this worker
    (:func:`_ended`), a stale fault of an epoch left, a death, a peer's fault."""
    ended = _ended(m, r, me, view, step, dead, finished, leaving)
    if ended is not None:
        return ended
    healed = (  # (a restore replaces every member's state, as a heal does the healed's)
        view is not None
        and (r.rank in view.needs_state or view.restore is not None or view.lost is not None)
        and view.has(r.rank, r.incarnation)
    )
    if r.self_reported and m.epoch < epoch and (r.severity is Severity.FAULT2 or healed):
        # A peer's own fault in an epoch this worker has left: the peer rolled that
        # epoch back itself and arrived at the formation this epoch came from (a
        # transient fault as it formed, it reports again, as one of the new epoch; a
        # lost state, its arrival said so and this epoch heals it, or restores every
        # member's from the durable tier after a total loss). Acted on, this
        # worker alone would roll back an epoch its peers go on in (the simulator:
        # two losses 1 ms apart, then a formation of one that declared a live peer
        # dead).
        return Routed(record=("stale_fault", {"rank": r.rank, "epoch": m.epoch}))
    newly_dead = None
    inc = r.incarnation
    if not inc and view is not None and r.rank in view.ranks:
        inc = view.incarnation(r.rank)  # (a monitor's "its current life": this one)
    # a monitor's Fault1 of the current life: its agent kills that life
    named = bool(inc) and not r.incarnation and r.severity is Severity.FAULT1
    if r.dead or (named and not r.self_reported):
        who = Member(r.rank, inc)
        if who in dead:
            # one death, several messages (stopped, then killed; declared dead, then
            # exited): the first one already started the recovery
            return NOTHING
        newly_dead = who
    if (
        view is not None
        and r.rank in view.ranks
        and r.incarnation
        in (
            0,
            view.incarnation(r.rank),
        )
    ):
        record = {
            "rank": r.rank,
            "incarnation": r.incarnation,
            "severity": r.severity.name,
            "cause": r.cause[:300],
            "kind": type(m).__name__,
            "sent": m.wall_time,
            "epoch": epoch,
            "step": step,
        }
        return Routed(
            events=(PeerFault(r.rank, r.severity, r.cause[:200]),),
            dead=newly_dead,
            record=("peer_fault", record),
        )
    return Routed(dead=newly_dead)


def _ended(
    m: Message,
    r: FaultReport,
    me: Member,
    view: EpochView | None,
    step: int,
    dead: Set[Member],
    finished: bool,
    leaving: Set[int],
) -> Routed | None:
    """:func:`_fault`'s first cases: a peer that finished the job, a drained peer's exit,
    a report of this worker itself; None: none of them."""
    if r.clean_exit and finished:
        # It finished the job after the last step, which this worker voted for too
        # and is still applying: an end, not a fault. (It acks nothing any more: a
        # worker draining at that last commit waited for its ack, found by the
        # simulator.)
        return Routed(
            events=(DrainAcked(r.rank),),
            record=("peer_finished", {"rank": r.rank, "incarnation": r.incarnation}),
            job_done=True,
        )
    in_view = view is not None and view.has(r.rank, r.incarnation)
    if r.drained and (r.rank in leaving or not in_view):
        # It left after a drain this worker knew of (its epoch re-forms without it,
        # with nothing rolled back), or from outside this worker's epoch (a formation
        # it was waiting in). Only its life is over. A drained member this worker
        # still counts on is a fault below, like any exit.
        who = Member(r.rank, r.incarnation)
        return Routed(
            # (a worker draining at the same commit waits for no ack from it)
            events=(DrainAcked(r.rank),),
            dead=who if r.incarnation and who not in dead else None,
            record=("peer_drained", {"rank": r.rank, "incarnation": r.incarnation}),
        )
    if r.rank == me.rank and r.incarnation in (0, me.incarnation):
        if isinstance(m, Fault) and m.sender != (me.rank, me.incarnation):
            # a monitor or an operator reports this worker faulty
            why = f"reported by {m.role.name.lower()}: {r.cause}"[:200]
            return Routed(
                events=(LocalFault(r.severity, why),),
                record=(
                    "reported_fault",
                    {
                        "step": step,
                        "incarnation": me.incarnation,
                        "severity": r.severity.name,
                        "cause": why,
                    },
                ),
            )
        return NOTHING
    return None


def _control(
    m: Message,
    me: Member,
    view: EpochView | None,
    epoch: int,
    dead: Set[Member],
    world_size: int | None,
) -> Routed:
    """:func:`route` of a member's control message: a rollback request, a drain notice or
    ack, a join request."""
    if view is None or m.rank == me.rank:
        return NOTHING  # not in an epoch yet (joins are admitted by the formation), or ours
    member = view.has(m.rank, m.incarnation)
    ev: Event | None = None
    if isinstance(m, RollbackRequest):
        ev = RollbackRequested(m.rank) if member and m.epoch == epoch else None
    elif isinstance(m, DrainNotice):
        if not member and m.epoch < epoch:
            # A leaver of an epoch this worker has already re-formed without it (it read
            # the decision that let it go, and formed the next one before the notice came):
            # it counts on the leaver no more. Unacked, the leaver would wait for this ack
            # until its grace ran out (30 s; found by a 3-node drain test).
            return Routed(ack_drain=m.rank, record=("drain_ack_late", {"rank": m.rank}))
        ev = DrainNoticed(m.rank, m.step) if member else None
    elif isinstance(m, DrainAck):
        ev = DrainAcked(m.rank) if m.drained_rank == me.rank else None

    elif isinstance(m, JoinRequest):
        outside = world_size is not None and not 0 <= m.rank < world_size
        if outside or member or Member(m.rank, m.incarnation) in dead:
            # A rank that cannot join this job (or a life that is in, or dead): acting on
            # it would re-form the epoch after every commit, for nothing.
            why = "outside the world" if outside else "dead" if not member else "a member"
            return Routed(record=("join_ignored", {"rank": m.rank, "why": why}))
        ev = JoinRequested(m.rank)
        first = view is not None and view.has(me.rank, me.incarnation)
        first = first and view is not None and view.index(me.rank) < ALIVE_REPLIERS
        return Routed(events=(ev,), alive=first)
    return Routed(events=(ev,)) if ev is not None else NOTHING


def _early(m: Message, me: Member, epoch: int) -> bool:
    """A peer's message about an epoch after this worker's: a rollback request (a
    formation's reminder), or its own fault report (a peer that adopted the epoch first rolls it back)."""
    if m.epoch <= epoch or m.rank == me.rank:
        return False
    if isinstance(m, RollbackRequest):
        return True
    return isinstance(m, Fault) and m.sender == (m.faulty_rank, m.faulty_incarnation)


EARLY_KEPT = 4096
"""Early messages kept (a worker keeps the newest): a fault report per member, and the
formation's reminders."""

REPEATED = frozenset({"join_ignored"})
"""Records a flood can repeat (a foreign worker announcing itself every 200 ms): logged
at their 1st, 10th, 100th, ... occurrence, with the count."""


def repeats_logged(count: int) -> bool:
    """Whether the ``count``-th occurrence of a repeated record is logged (1, 10, 100...)."""
    if count < 1:
        return False
    while count % 10 == 0:
        count //= 10
    return count == 1
