"""A simulated life's main-thread actions that wait: the vote and its decision, the
formations (as a survivor and as a joiner), adopting a view, the process group's build and
the heal. Each is a slice the scheduler runs again until the wait ends, through the real
coordinator's rounds (:meth:`~fastft.runtime.engine.survivors.Survivors.round`,
``joiner_round``, ``vote``, ``await_decision``) over the simulated store."""

from __future__ import annotations

from typing import Any

from fastft.fsm import (
    CastVote,
    CommitApplied,
    Decision,
    Event,
    FormEpoch,
    HealDone,
    Phase,
    QuorumReady,
)
from fastft.protocol import JoinRequest, Severity
from fastft.protocol.exits import EXIT_DRAINED, EXIT_STATE_LOST
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.endings import JobFinished
from fastft.runtime.engine import decisions
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.core import Core, OnCore
from fastft.runtime.engine.formation import JoinerWait, SurvivorWait, others_hold_state
from fastft.runtime.engine.survivors import Survivors
from fastft.sim.faults import CORRUPT, corruption
from fastft.sim.ports import Host

__all__ = ["POLL_S", "RTT_S", "Ended", "Waits"]

POLL_S = 0.002  # the coordinator's polls
RTT_S = 0.0005  # a store round trip, or a collective's last arrival to its end


class Ended(Exception):  # noqa: N818 - a life's end, not an error
    """The life's process ends with ``code`` (``why``)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code
        self.why = why


class Waits(OnCore):
    """The waiting actions of :class:`~fastft.sim.life.Life` (its base): the vote, the
    formations, the join, the process group and the heal of the core's
    :class:`~fastft.runtime.engine.core.MainThread`, and their slices."""

    w: Host
    me: Member
    rank: int
    inc: int
    core: Core
    coord: Coordinator
    survivors: Survivors
    h: str
    held: int
    alive: bool
    suspect: bool
    recoveries: int
    next_announce: float

    def feed(self, event: Event) -> None:
        raise NotImplementedError

    def wait(self, pc: tuple[Any, ...], delay: float) -> float:
        raise NotImplementedError

    def back_to_drive(self) -> float:
        raise NotImplementedError

    def local_fault(self, severity: Severity, cause: str, gen: int | None) -> None:
        raise NotImplementedError

    def declare_silent(self, ranks: frozenset[int]) -> None:
        raise NotImplementedError

    def remind(self) -> None:
        raise NotImplementedError

    def enter(self, view: EpochView) -> None:
        """The core adopts ``view`` (its effects: the life)."""
        raise NotImplementedError

    def vote(self, a: CastVote) -> float:
        w = self.w
        view = self.view
        assert view is not None
        w.checks.vote(self, a.epoch, a.step)
        if a.agreed:  # decided by the step's collective: no store request
            w.checks.decision(self, a.epoch, a.step, "C")
            self.pc = ("drive",)
            self.feed(Decision(commit=True))
            return 0.0
        got = self.coord.vote(
            a.epoch,
            a.step,
            len(view.members),
            leaving=a.want_drain,
            joining=a.joining,
            ranks=tuple(sorted(view.ranks)),
        )
        if got is not None:
            return self.decided(a.epoch, a.step, got)
        return self.wait(("vote", a.epoch, a.step), RTT_S)

    def _vote(self, epoch: int, step: int) -> float:
        got = self.coord.await_decision(epoch, step)
        if got is None:
            return self.wait(("vote", epoch, step), RTT_S)
        return self.decided(epoch, step, got)

    def decided(self, epoch: int, step: int, got: str) -> float:
        parsed = decisions.parse_commit(got)
        admit, leaving = parsed if parsed is not None else (False, frozenset[int]())
        view = self.view
        if parsed is not None and view is not None and view.index(self.rank) == 0 and step > 0:
            decisions.forget(self.w.store, self.w.keys, epoch, step - 1)  # the key collector
        self.w.checks.decision(self, epoch, step, got)
        self.pc = ("drive",)
        self.feed(Decision(commit=parsed is not None, admit=admit, leaving=leaving))
        return 0.0

    def apply(self, step: int) -> None:
        w = self.w
        w.checks.apply(self, step)
        if self.view is not None and self.view.index(self.rank) == 0:
            w.store.set(w.keys.committed, str(step + 1))  # (the key collector's record)
        flip = corruption(self.h)  # (a corrupted state stays corrupted, the same flip's)
        self.h = w.next_hash(self.h, step) + ("" if flip is None else CORRUPT + flip)
        self.held = step + 1
        self.recoveries = 0
        w.after_commit(self, step)
        self.feed(CommitApplied())

    def form(self, a: FormEpoch) -> float:
        prev = self.view
        assert prev is not None
        exclude = a.exclude | frozenset(m.rank for m in prev.members if m in self.dead)
        if self.may_drain(prev, exclude):
            raise Ended(EXIT_DRAINED, "drained (from a formation)")
        wait = self.survivors.arrive(
            prev,
            exclude,
            step=self.state.step,
            lost_state=a.lost_state,
            timeout_s=self.w.opts.rollback_timeout_s,
            admit=not (a.rollback and self.w.opts.elastic),
            suspect=self.suspect,
        )
        self.w.fire_due(self, "formation")
        return self.wait(("form", wait, self.action_gen), 0.0)

    def may_drain(self, prev: EpochView, gone: frozenset[int]) -> bool:
        """:meth:`fastft.runtime.engine.membership.Membership._may_drain`."""
        s = self.state
        return s.want_drain and others_hold_state(
            prev, self.me, self.dead, s.step, gone | s.leaving
        )

    def cancelled(self, phase: Phase, gen: int) -> bool:
        return self.state.phase is not phase or self.phase_changes != gen or self.core.finished

    def _form(self, wait: SurvivorWait, gen: int) -> float:
        view = self.coord.closed(wait.epoch)
        if view is None:
            prev = wait.prev  # (the epoch being left: who is not expected leaves it)
            drain = self.may_drain(
                prev, frozenset(m.rank for m in prev.members) - set(wait.expected)
            )
            if self.cancelled(Phase.HEALING, gen) or drain:
                if drain:
                    raise Ended(EXIT_DRAINED, "drained (from a formation)")
                return self.back_to_drive()
            try:
                view = self.survivors.round(wait, silent=self.declare_silent, remind=self.remind)
            except JobFinished as e:
                raise Ended(0, f"the job finished at step {e.step}") from e
            if view is None:
                return self.wait(("form", wait, gen), POLL_S)
        self.pc = ("drive",)
        if not view.has(self.rank, self.inc):
            self.feed(QuorumReady(view.epoch, view.ranks, view.step, view.needs_state))
            return 0.0
        self.adopt(view)
        return 0.0

    def join(self) -> float:
        wait = self.coord.register(self.w.opts.start_timeout_s, self.w.opts.regroup_timeout_s)
        self.next_announce = self.w.now
        return self.wait(("join", wait, self.action_gen), 0.0)

    def _join(self, wait: JoinerWait, gen: int) -> float:
        if self.cancelled(Phase.INIT, gen) or self.state.want_drain:
            if self.state.want_drain:
                raise Ended(EXIT_DRAINED, "drained (while waiting to join)")
            return self.back_to_drive()
        if self.w.now >= self.next_announce and wait.seen > 0:
            msg = JoinRequest(job=self.w.keys.job, epoch=0, rank=self.rank, incarnation=self.inc)
            self.w.broadcast(self, msg)
            self.next_announce = self.w.now + 0.2
        try:
            view = self.coord.joiner_round(wait)
        except JobFinished as e:
            raise Ended(0, f"the job finished at step {e.step}") from e
        if view is None:
            return self.wait(("join", wait, gen), 0.01 if wait.seen == 0 else POLL_S)
        self.pc = ("drive",)
        self.adopt(view)
        return 0.0

    def adopt(self, view: EpochView) -> None:
        w = self.w
        w.checks.view(self, view)
        if view.restore is not None:
            got = w.checkpoints.get(view.restore)
            if got is None:
                raise Ended(EXIT_STATE_LOST, f"no checkpoint of step {view.restore} to load")
            self.h, self.held = got, view.restore
            w.checks.restored(self, view.restore)
        elif view.lost is not None and view.fatal:
            if w.opts.allow_fresh_start:
                raise Ended(1, f"state lost at step {view.lost}; restarting")
            raise Ended(EXIT_STATE_LOST, f"every holder of step {view.lost} was lost")
        self.suspect = False
        self.enter(view)

    def _pg(self, epoch: int, gen: int) -> float:
        """The epoch's process group: a rendezvous of its members, which a fault (the
        machine moving on) cancels; nothing else ends it (the real one times out after
        60 s: the simulator reports such a wait)."""
        w = self.w
        if self.cancelled(self.state.phase, gen) or self.state.epoch != epoch:
            return self.back_to_drive()
        w.pg_arrivals.setdefault(epoch, set()).add(self.me)
        view = self.view
        assert view is not None
        if all(m in w.pg_arrivals[epoch] for m in view.members):
            w.built[self.me] = epoch
            return self.back_to_drive()
        return self.wait(("pg", epoch, gen), RTT_S)

    def _heal(self, epoch: int, step: int, gen: int) -> float:
        """The heal: the source and the members that need state meet; each receiver takes
        the source's state. A peer of the heal that died makes it fail (Gloo: the socket
        closed); a fault that moved the machine interrupts it."""
        w = self.w
        if self.cancelled(Phase.HEALING, gen):
            return self.back_to_drive()
        view = self.view
        assert view is not None and view.source is not None
        src = Member(view.source, view.incarnation(view.source))
        party = [src] + [m for m in view.members if m.rank in view.needs_state]
        there = w.heal_arrivals.setdefault(epoch, set())
        if self.me not in there:
            there.add(self.me)
            w.fire_due(self, "heal")  # a death in the middle of the transfer
            if not self.alive:
                return 0.0
        if any(m in w.lives and not w.lives[m].alive for m in party):
            self.local_fault(Severity.FAULT2, "RuntimeError: heal peer closed", gen)
            return self.back_to_drive()
        if not all(m in w.heal_arrivals[epoch] for m in party):
            return self.wait(("heal", epoch, step, gen), RTT_S)
        if self.me != src:
            source = w.lives[src]
            w.checks.heal_source(self, source)
            self.h, self.held = source.h, source.held
        self.pc = ("drive",)
        self.feed(HealDone())
        return 0.0
