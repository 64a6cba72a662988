"""Epoch formation, the decisions: who is admitted, who heals, who sends. Pure.

The store I/O around it (arrivals, joiner keys, the closing compare-and-set) is
:mod:`fastft.runtime.engine.coordinator`; the protocol is described there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from fastft.runtime.contract import REGROUP_TIMEOUT_S, EpochView, Member

__all__ = [
    "Arrival",
    "JoinerWait",
    "Recovery",
    "SurvivorWait",
    "close_after",
    "close_first",
    "holds_state",
    "others_hold_state",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arrival:
    """A survivor's arrival at the next epoch: its life, its committed step, whether it
    lost its state, and the kept gradient ``(lo, hi, n)`` it holds of ``step``, if any.
    ``suspect``: its state may have been touched (an exception escaped its step loop:
    an in-process restart); it heals from a member whose state is not suspect, and serves
    as the source only when no such member is left (every rank raised in an evaluation)."""

    incarnation: int
    step: int
    lost: bool
    kept: tuple[int, int, int] | None = None
    suspect: bool = False
    rewind: int | None = None
    """The step of the verified state it holds
    (:class:`~fastft.runtime.state.verified.Verified`); with ``lost``, the one it goes
    back to: a replica mismatch's repair, its state lost on purpose (None: not one)."""

    def to_json(self) -> str:
        d: dict[str, object] = {"inc": self.incarnation, "step": self.step, "lost": self.lost}
        if self.kept is not None and not self.lost:
            d["kept"] = list(self.kept)
        if self.suspect:
            d["suspect"] = True
        if self.rewind is not None:
            d["rewind"] = self.rewind
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Arrival:
        d = json.loads(raw)
        kept = d.get("kept")
        return cls(
            int(d["inc"]),
            int(d["step"]),
            bool(d["lost"]),
            tuple(int(v) for v in kept) if kept else None,  # type: ignore[arg-type]
            bool(d.get("suspect", False)),
            None if d.get("rewind") is None else int(d["rewind"]),
        )


@dataclass(frozen=True)
class Recovery:
    """What can replace a committed state that no live member holds: the step of the
    newest usable durable checkpoint (None: none), and whether the job may start again
    from step 0 (``--allow-fresh-start``)."""

    checkpoint: int | None = None
    fresh_start: bool = False
    resume: int | None = None
    """A fresh process's own: the step of the state its script loaded from a checkpoint of
    its own and registered (``ft.register(step=...)``); every joiner holds one."""


@dataclass
class SurvivorWait:
    """A survivor's wait for ``prev.epoch + 1`` (:meth:`Coordinator.arrive`)."""

    prev: EpochView
    expected: list[int]
    step: int
    lost_state: bool
    admit: bool
    started: float
    deadline: float
    first: bool = False
    """It arrived first: it reminds the members still missing and declares a closer that
    never arrived dead (:meth:`.survivors.Survivors.round`)."""
    closing: bool = False
    """It was the closer at its last round (the others block on the closed view)."""
    counted: tuple[int, tuple[int, ...]] = (-1, ())
    """The closer's last read of the arrival keys: the counter and the live expected..."""
    arrived: dict[int, Arrival] = field(default_factory=dict)
    """... and what it read (NATS: ``read_at``, when)."""
    read_at: float = float("-inf")
    watch: Any = None
    """NATS: the closer's watch of the epoch's arrival keys (their values pushed as they
    are written, none read key by key), once it closes; closed with the wait."""
    checked: float = float("-inf")
    """When it last asked whether the job finished."""
    reminded: float = float("-inf")
    reminders: int = 0
    passed: frozenset[int] = frozenset()
    """Members it gave up on for not arriving by the deadline (declared dead)."""
    checked_closer: frozenset[int] = frozenset()
    """Closers whose arrival it read past the deadline."""
    beats: int = 0
    beat_at: float = float("-inf")
    """As the closer: its beats written, and when it last wrote one."""
    beat_seen: bytes | None = None
    beat_moved: float = float("-inf")
    beat_read: float = float("-inf")
    """Past the deadline: the closer's beat as last read, when it was seen to move, and
    when it was last read."""

    @property
    def epoch(self) -> int:
        return self.prev.epoch + 1


@dataclass
class JoinerWait:
    """A joiner's wait (:meth:`Coordinator.register`); ``seen``: the last epoch it read."""

    started: float
    seen: int
    start_timeout_s: float
    regroup_timeout_s: float
    scanned: float = float("-inf")
    """When it last read every joiner key after its timeout (a few times a second)."""
    announce_at: float = float("-inf")
    """When it next asks the members of a live epoch to admit it."""


def holds_state(arrived: dict[int, Arrival]) -> bool:
    """Whether any survivor arrived with the committed state."""
    return any(not a.lost for a in arrived.values())


def _rewind_to(arrived: dict[int, Arrival]) -> int | None:
    """The verified step every survivor goes back to: one that a survivor which lost its
    state on purpose asks for (a replica mismatch's repair), and that every survivor
    holds; None if not all can (the others' state serves, or a checkpoint)."""
    asked = {a.rewind for a in arrived.values() if a.lost}
    if len(asked) != 1 or (v := asked.pop()) is None:
        return None
    return v if all(a.rewind == v for a in arrived.values()) else None


def others_hold_state(
    view: EpochView | None,
    me: Member,
    dead: Collection[Member],
    step: int,
    leaving: Collection[int] = (),
) -> bool:
    """Whether a live member of ``view`` besides ``me`` and the ranks ``leaving`` (drains
    announced, members left out of the next epoch) holds the committed state of ``step``:
    any of them once a step was committed in the epoch (``step > view.step``: every heal
    of it was done), else those it did not heal. A worker asked to drain leaves from a
    formation at once only then; otherwise it takes part, heals the others and leaves at
    its next commit (the last holder of the state never takes it away)."""
    if view is None:
        return False
    healed = step > view.step
    return any(
        m != me
        and m not in dead
        and m.rank not in leaving
        and (healed or m.rank not in view.needs_state)
        for m in view.members
    )


def close_after(
    prev: EpochView,
    arrived: dict[int, Arrival],
    joiners: dict[int, int],
    *,
    expected: list[int],
    timed_out: bool,
    admit: bool,
    min_members: int,
    recovery: Recovery = Recovery(),
) -> EpochView | None:
    """The view the closer of ``prev.epoch + 1`` writes, or None to wait: for the survivors
    it ``expected`` to arrive (until ``timed_out``), and for restarted workers while fewer
    than ``min_members`` take part. ``joiners``: registered joiners (rank -> incarnation)
    that did not arrive as survivors; ``admit`` False leaves them out (``waiting``) when the
    survivors are enough without them. When no survivor holds the state, ``recovery``
    decides: every member restores the checkpoint; or a joiner (a fresh process) is the
    source of a start from step 0; or the view is :attr:`EpochView.fatal`. A member that
    lost its state is never admitted as if it held it."""
    if not set(expected) <= set(arrived) and not timed_out:
        return None
    waiting: tuple[int, ...] = ()
    if not admit and joiners and len(arrived) >= min_members:
        waiting, joiners = tuple(sorted(joiners)), {}
    if len(arrived) + len(joiners) < min_members:
        return None  # wait for restarted workers
    members = [Member(r, a.incarnation) for r, a in arrived.items()]
    members += [Member(r, inc) for r, inc in joiners.items()]
    # A step decided by its collective may have committed on the members that completed
    # it and not on one that a fault interrupted first: the epoch resumes from the newest
    # step a survivor holds, and a survivor behind it heals (docs/architecture.md).
    held = [a.step for a in arrived.values() if not a.lost]
    top = max(held) if held else None
    behind = frozenset(r for r, a in arrived.items() if not a.lost and a.step != top)
    clean = sorted(r for r, a in arrived.items() if not a.lost and not a.suspect)
    suspects = sorted(r for r, a in arrived.items() if not a.lost and a.suspect)
    clean_top = [r for r in clean if r not in behind]
    suspects_top = [r for r in suspects if r not in behind]
    # (a suspect state is the committed one, if untouched)
    with_state = clean_top or suspects_top
    if suspects_top and not clean_top:
        log.warning(
            "every survivor's state is suspect (an exception escaped each one's step loop): "
            "rank %d's serves, the others heal from it",
            suspects_top[0],
        )
    needs = frozenset(joiners) | frozenset(r for r, a in arrived.items() if a.lost) | behind
    needs |= frozenset(suspects) - {with_state[0]} if with_state else frozenset()
    steps = {arrived[r].step for r in with_state}
    if behind:
        log.info("survivors %s are behind step %s: they heal", sorted(behind), top)
    epoch, members_ = prev.epoch + 1, tuple(sorted(members))
    if (v := _rewind_to(arrived)) is not None and len(arrived) >= min_members:
        return _rewind(prev, arrived, v, (*waiting, *joiners))
    if not with_state:
        return _lost(prev, arrived, members_, joiners, recovery)
    step = max(steps)
    kept = tuple(
        (r, *a.kept)
        for r, a in sorted(arrived.items())
        if a.kept and not a.lost and not a.suspect and a.step == step
    )
    return EpochView(
        epoch=epoch,
        members=members_,
        step=step,
        needs_state=needs,
        source=with_state[0],
        kept=kept,
        waiting=waiting,
    )


def _rewind(
    prev: EpochView, arrived: dict[int, Arrival], v: int, waiting: tuple[int, ...]
) -> EpochView:
    """A replica mismatch's repair: every survivor goes back to the state it holds of the
    last step the check found equal, ``v`` (``waiting``, the joiners, wait: none holds it).
    A survivor that a peer's repair interrupted before its own verdict arrives holding the
    state, and goes back too: the verdict of the members that decided is the one every
    member would have reached, and the state it holds may be the corrupted one."""
    lost = max([prev.step, *(a.step for a in arrived.values())])
    members = tuple(sorted(Member(r, a.incarnation) for r, a in arrived.items()))
    waits = tuple(sorted(set(waiting)))
    return EpochView(prev.epoch + 1, members, v, frozenset(), None, (), waits, v, lost, rewind=True)


def _lost(
    prev: EpochView,
    arrived: dict[int, Arrival],
    members: tuple[Member, ...],
    joiners: dict[int, int],
    recovery: Recovery,
) -> EpochView:
    """Every holder of the committed state is gone (at least ``prev.step`` was committed):
    every member restores the checkpoint, or a joiner (a fresh process) is the source of
    a start from step 0, or the view is :attr:`EpochView.fatal`."""
    epoch = prev.epoch + 1
    lost = max([prev.step, *(a.step for a in arrived.values())])
    if recovery.checkpoint is not None:
        c = recovery.checkpoint
        return EpochView(epoch, members, c, frozenset(), None, restore=c, lost=lost)
    if (recovery.fresh_start or lost == 0) and joiners:
        # (lost == 0: nothing was committed yet, so a fresh process holds the whole
        # state: the first heal's source died, found by the simulator)
        src = min(joiners)
        needs = frozenset(m.rank for m in members) - {src}
        return EpochView(epoch, members, 0, needs, src, lost=lost)
    return EpochView(epoch, members, lost, frozenset(), None, lost=lost)


def close_first(
    joiners: dict[int, int],
    *,
    me: int,
    latest: int,
    world_size: int,
    min_members: int,
    waited_s: float,
    start_timeout_s: float,
    regroup_timeout_s: float = REGROUP_TIMEOUT_S,
    last_step: int = 0,
    recovery: Recovery = Recovery(),
    live: bool = False,
) -> EpochView | None:
    """The view joiner ``me`` writes when every slot is a joiner (the first start, or every
    worker was lost), or with at least ``min_members`` once it waited ``start_timeout_s``
    (the first start) or ``regroup_timeout_s`` (after every worker was lost: a slot may be
    gone for good, or its restart lost again; the rest join at a later step); None if it is
    not the one to close (or not yet). ``latest``: the last closed epoch (0: none), whose
    step was ``last_step``. A first start resumes from ``recovery.checkpoint`` if there is
    one; after every worker was lost, ``recovery`` decides as in :func:`close_after`.
    ``live``: a member of epoch ``latest`` answered lately: not every worker was lost, so
    no joiner closes a world of its own (it waits to be admitted); only every slot a
    joiner (each member's slot holds a new life) closes then."""
    first_start = latest == 0
    everyone = len(joiners) == world_size
    if live and not first_start and not everyone:
        return None
    waited_enough = waited_s > (start_timeout_s if first_start else regroup_timeout_s)
    enough_late = waited_enough and len(joiners) >= min_members
    if not (everyone or enough_late) or min(joiners) != me:
        return None
    members = tuple(sorted(Member(r, inc) for r, inc in joiners.items()))
    epoch, lost = latest + 1, None if first_start else last_step
    c, own = recovery.checkpoint, recovery.resume
    if c is not None and (own is None or c >= own):  # resume, or restore after a total loss
        return EpochView(epoch, members, c, frozenset(), None, restore=c, lost=lost)
    if own is None and lost and not recovery.fresh_start:  # (lost == 0: nothing committed)
        return EpochView(epoch, members, lost, frozenset(), None, lost=lost)
    source = members[0].rank
    return EpochView(
        epoch=epoch,
        members=members,
        # (a script's own checkpoint: the step of the state it registered)
        step=own or 0,
        # At the first start every worker built its model from the same seed; the lowest
        # sends its state anyway so that S3 holds from step 0.
        needs_state=frozenset(m.rank for m in members) - {source},
        source=source,
        lost=lost,
    )
