"""A simulated life's main-thread actions that wait: the vote and its decision, the
formations (as a survivor and as a joiner), adopting a view, the process group's build and
the heal. Each is a slice the scheduler runs again until the wait ends, through the real
coordinator's rounds (:meth:`~fastft.runtime.engine.survivors.Survivors.round`,
``Joiners.round``, ``vote``, ``await_decision``) over the simulated store."""

from __future__ import annotations

from typing import Any

from fastft.fsm import CastVote, CommitApplied, Event, FormEpoch, HealDone, Phase
from fastft.protocol import JoinRequest, Severity
from fastft.protocol.exits import EXIT_DRAINED, EXIT_STATE_LOST
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine import decisions, plans
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.core import Core, OnCore
from fastft.runtime.engine.formation import JoinerWait, SurvivorWait
from fastft.runtime.engine.joiners import Joiners
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
    joiners: Joiners
    h: str
    held: int
    alive: bool
    suspect: bool
    recoveries: int
    commits: int

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
        known = plans.voted(a)
        if known is not None:  # decided by the step's collective: no store request
            w.checks.decision(self, a.epoch, a.step, "C")
            self.pc = ("drive",)
            self.feed(known)
            return 0.0
        joiners = self.coord.joiners() if plans.needs_joiners(a, 1) else None
        got = self.coord.vote(
            a.epoch,
            a.step,
            len(view.members),
            leaving=a.want_drain,
            joining=plans.vote_joining(a, 1, joiners),
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
        do = plans.decided(self.view, self.rank, step, got)
        if do.forget is not None:
            decisions.forget(self.w.store, self.w.keys, epoch, do.forget)  # the key collector
        self.w.checks.decision(self, epoch, step, got)
        self.pc = ("drive",)
        self.feed(do.decision)
        return 0.0

    def apply(self, step: int) -> None:
        w = self.w
        w.checks.apply(self, step)
        if plans.records(self.view, self.rank):
            w.store.set(w.keys.committed, str(step + 1))  # (the key collector's record)
        flip = corruption(self.h)  # (a corrupted state stays corrupted, the same flip's)
        self.h = w.next_hash(self.h, step) + ("" if flip is None else CORRUPT + flip)
        self.held = step + 1
        self.commits += 1
        self.recoveries = 0
        w.after_commit(self, step)
        self.feed(CommitApplied())

    def form(self, a: FormEpoch) -> float:
        prev = self.view
        assert prev is not None
        plan = plans.form(
            a,
            prev,
            self.me,
            self.dead,
            self.state,
            suspect=self.suspect,
            elastic=self.w.opts.elastic,
            verified=None,  # (verified states are not modelled: no repair rewinds)
            wanted=None,
        )
        self.drain_from_formation(prev, plan)
        wait = self.survivors.arrive(
            prev,
            plan.exclude,
            step=self.state.step,
            lost_state=a.lost_state,
            timeout_s=self.w.opts.rollback_timeout_s,
            admit=plan.admit,
            suspect=self.suspect,
            rewind=plan.rewind,
        )
        self.w.fire_due(self, "formation")
        return self.wait(("form", wait, plan, self.action_gen), 0.0)

    def drain_from_formation(self, prev: EpochView, plan: plans.Form) -> None:
        """:meth:`fastft.runtime.engine.membership.Membership._drain_from_formation`: the
        same plan; a checkpoint written by a leaver is the state it holds."""
        s = self.state
        do = plans.drain(prev, plan.exclude, self.me, self.dead, s, plan.holds)
        if do.leaves:
            if do is plans.Drain.LEAVE_WRITING:
                self.write_held(s.step)
            raise Ended(EXIT_DRAINED, "drained (from a formation)")
        if (
            do is plans.Drain.LAST
            and plans.holder_leaves(bool(self.coord.joiners()))
            and self.write_held(s.step)
        ):
            raise Ended(EXIT_DRAINED, f"drained (from a formation, step {s.step} checkpointed)")

    def write_held(self, step: int) -> bool:
        """:meth:`fastft.runtime.durable.commit.Commits.covers`: a checkpoint of ``step``
        exists, or this member writes the state it holds (with checkpoints on)."""
        w = self.w
        if not w.opts.checkpoint_every:
            return False
        if step not in w.checkpoints and self.held == step:
            w.checkpoints[step] = self.h
        return step in w.checkpoints

    def cancelled(self, phase: Phase, gen: int) -> bool:
        return self.state.phase is not phase or self.phase_changes != gen or self.core.finished

    def _form(self, wait: SurvivorWait, plan: plans.Form, gen: int) -> float:
        view = self.coord.closed(wait.epoch)
        if view is None:
            s, prev = self.state, wait.prev
            leaves = plans.drain(prev, plan.exclude, self.me, self.dead, s, plan.holds).leaves
            if self.cancelled(Phase.HEALING, gen) or leaves:
                self.drain_from_formation(prev, plan)
                return self.back_to_drive()
            r = self.survivors.round(wait)
            if r.silent:
                self.declare_silent(r.silent)
            if r.remind:
                self.remind()
            if r.finished is not None:
                raise Ended(0, f"the job finished at step {r.finished}")
            if r.view is None:
                return self.wait(("form", wait, plan, gen), POLL_S)
            view = r.view
        self.pc = ("drive",)
        out = plans.outsider(view, self.me)
        if out is not None:
            self.feed(out)
            return 0.0
        self.adopt(view)
        return 0.0

    def join(self) -> float:
        wait = self.joiners.register(self.w.opts.start_timeout_s, self.w.opts.regroup_timeout_s)
        return self.wait(("join", wait, self.action_gen), 0.0)

    def _join(self, wait: JoinerWait, gen: int) -> float:
        leaves = plans.joiner_leaves(self.state)
        if self.cancelled(Phase.INIT, gen) or leaves:
            if leaves:
                raise Ended(EXIT_DRAINED, "drained (while waiting to join)")
            return self.back_to_drive()
        r = self.joiners.round(wait)
        if r.announce:
            msg = JoinRequest(job=self.w.keys.job, epoch=0, rank=self.rank, incarnation=self.inc)
            self.w.broadcast(self, msg)
        if r.finished is not None:
            raise Ended(0, f"the job finished at step {r.finished}")
        if r.view is None:
            return self.wait(("join", wait, gen), 0.01 if wait.seen == 0 else POLL_S)
        self.pc = ("drive",)
        self.adopt(view=r.view)
        return 0.0

    def adopt(self, view: EpochView) -> None:
        w = self.w
        w.checks.view(self, view)
        do = plans.recover(view, w.opts.allow_fresh_start)
        if do is plans.Recover.REWIND:
            w.violation(f"{self}: a rewind view, which no simulated arrival asks for")
        if do in (plans.Recover.RESTORE, plans.Recover.REWIND):
            assert view.restore is not None
            got = w.checkpoints.get(view.restore)
            if got is None:
                raise Ended(EXIT_STATE_LOST, f"no checkpoint of step {view.restore} to load")
            self.h, self.held = got, view.restore
            w.checks.restored(self, view.restore)
        elif do is plans.Recover.FRESH_RESTART:
            raise Ended(1, f"state lost at step {view.lost}; restarting")
        elif do is plans.Recover.STATE_LOST:
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
