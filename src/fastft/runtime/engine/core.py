"""The engine's core: one worker's step engine, run the same way by the executor (threads
and a lock) and by the deterministic simulator (slices of simulated time).

The core holds what the engine decides with: the state machine's state, the epoch's view,
the lives known dead, the main thread's queue and the rollback messages kept for an epoch
not adopted yet. It feeds events to :func:`fastft.fsm.decide`, performs the *immediate*
actions through an :class:`Effects` port, hands the main thread its queued actions one at
a time (stale ones dropped: :func:`fastft.runtime.engine.queue.stale`), and maps each to a method of a
:class:`MainThread` port (:meth:`Core.run`): the one table in the codebase from an action
to what performs it. The owner serialises calls (the executor holds its lock; the
simulator has one thread); the ports perform, the core decides.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastft.fsm import (
    AbortProcessGroup,
    Action,
    ApplyCommit,
    BroadcastDrainNotice,
    CancelFutures,
    CastVote,
    ConfigureProcessGroup,
    Deadline,
    DeclareDead,
    Event,
    ExitWorker,
    FetchState,
    FormEpoch,
    InterruptStep,
    InvalidTransition,
    LocalFault,
    PeerFault,
    Phase,
    ProposeRollback,
    QuorumReady,
    ReportFault,
    SendDrainAck,
    SendState,
    StepState,
    ZeroGrads,
    decide,
    initial_state,
)
from fastft.protocol import DrainAck, DrainNotice, Fault, Heartbeat, Message, Severity
from fastft.protocol.faults import fault_of
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.coreports import Effects, MainThread
from fastft.runtime.engine.inbox import EARLY_KEPT, route
from fastft.runtime.engine.queue import MAIN_ACTIONS, moved, stale

__all__ = ["JOIN", "Core", "Effects", "MainThread", "OnCore", "Seen", "Wait"]

log = logging.getLogger(__name__)

R = TypeVar("R")
Check = Callable[[StepState], bool]


class _Join(Action):
    """The INIT phase's join: no action of the state machine, the main thread's own."""


JOIN = _Join()


class Wait(enum.Enum):
    """What :meth:`Core.next` returns when the main thread has no action to run."""

    DONE = "done"
    """The caller's ``done(state)`` holds: return to the script."""
    LEFT = "left"
    """The machine is in EXIT: the worker leaves (``state.reason`` says why)."""
    AGAIN = "again"
    """A drain's deadline was fed: look again."""
    FINISHED = "finished"
    """The other members finished the job while this one re-formed or joined: nothing is
    left for it to train (it ends with status 0)."""
    IDLE = "idle"
    """Nothing to do: wait for an event."""


@dataclass(frozen=True)
class Seen:
    """The engine at one moment (taken under its owner's lock): what a part reads of it
    without taking the lock itself."""

    state: StepState
    view: EpochView | None
    phase_changes: int


class OnCore:
    """The core's state as its owner shows it (read-only) to the parts, the runtime, the
    simulator's world and its checks."""

    core: Core

    @property
    def state(self) -> StepState:
        return self.core.state

    @property
    def view(self) -> EpochView | None:
        return self.core.view

    @property
    def dead(self) -> set[Member]:
        return self.core.dead

    @property
    def todo(self) -> collections.deque[tuple[int, int, Action]]:
        return self.core.todo

    @property
    def phase_changes(self) -> int:
        return self.core.phase_changes

    @property
    def phase_since(self) -> float:
        return self.core.phase_since

    @property
    def action_gen(self) -> int:
        return self.core.action_gen


class Core:
    """One worker's engine state and its rules. ``dead`` is the worker's one set of
    lives known dead (its coordinator reads it); ``clock`` is the owner's."""

    def __init__(
        self,
        me: Member,
        job: str,
        *,
        rollback_timeout_s: float,
        world_size: int | None,
        clock: Callable[[], float],
        dead: set[Member] | None = None,
    ) -> None:
        self.me = me
        self.job = job
        self.rollback_timeout_s = rollback_timeout_s
        self.world_size = world_size
        self.clock = clock
        self.state: StepState = initial_state(me.rank)
        self.view: EpochView | None = None
        self.dead: set[Member] = dead if dead is not None else set()
        self.todo: collections.deque[tuple[int, int, Action]] = collections.deque()
        """Main-thread actions with the phase changes and the epoch they were queued at."""
        self.early: collections.deque[Message] = collections.deque(maxlen=EARLY_KEPT)
        """Rollback messages of an epoch not adopted yet (:attr:`.inbox.Routed.early`)."""
        self.phase_changes = 0
        self.phase_since = clock()
        self.action_gen = 0
        """The phase changes when the main thread's current action was queued."""
        self.finished = False
        """A member finished the job while this one re-formed, healed or joined (found by
        the simulator: a worker that lost its state as its peers committed the last step
        waited for a joiner that had seen the end and left)."""

    def header(self) -> dict[str, Any]:
        s = self.state
        return dict(
            job=self.job,
            epoch=s.epoch,
            rank=self.me.rank,
            incarnation=self.me.incarnation,
            step=s.step,
        )

    def fault(self, severity: Severity, cause: str, rank: int | None = None, inc: int = 0) -> Fault:
        """A fault notice from this worker: its own, or of ``rank``'s life ``inc``."""
        if rank is None:
            rank, inc = self.me.rank, self.me.incarnation
        head = self.header()
        return Fault(
            **head, severity=severity, cause=cause[:2000], faulty_rank=rank, faulty_incarnation=inc
        )

    # --- events ----------------------------------------------------------------------------
    def feed(self, event: Event, fx: Effects) -> None:
        before = self.state
        try:
            new, actions = decide(before, event)
        except InvalidTransition as e:
            fx.invalid(e)
            return
        self.state = new
        went = moved(before, new, actions)
        if went:
            self.phase_since = self.clock()
            self.phase_changes += 1
        fx.transition(before, new, event, went)
        for a in actions:
            if isinstance(a, MAIN_ACTIONS):
                self.todo.append((self.phase_changes, new.epoch, a))
                continue
            try:
                self.perform(a, fx)
            except Exception as e:  # noqa: BLE001 - the transition's other actions must run
                # (a proposal's store call: without the formation after it this worker
                # waited in HEALING forever; every peer proposes too: the simulator)
                fx.failed(a, e)
        fx.woken()

    def perform(self, a: Action, fx: Effects) -> None:
        """An immediate action (also run directly: a formation declares silent members
        dead)."""
        s = self.state
        if isinstance(a, InterruptStep):
            fx.interrupt(a.reason, s.epoch, s.step)
        elif isinstance(a, ProposeRollback):
            fx.propose_rollback(a.epoch, a.step, a.reason)
        elif isinstance(a, AbortProcessGroup):
            fx.abort_group(s.epoch, s.step)
        elif isinstance(a, CancelFutures):
            fx.cancel()
        elif isinstance(a, BroadcastDrainNotice):
            # (the step it committed, not its count: a member still PREPARED on it learns
            # from the notice that the decision was a commit)
            head = {**self.header(), "epoch": a.epoch, "step": a.step}
            fx.broadcast(DrainNotice(**head, reason=a.reason[:2000]))
        elif isinstance(a, SendDrainAck):
            fx.broadcast(DrainAck(**self.header(), drained_rank=a.rank))
        elif isinstance(a, ReportFault):  # (its own fault, again: see StepState.refault)
            fx.record("fault_again", {"epoch": a.epoch, "step": s.step, "cause": a.cause[:300]})
            fx.broadcast(self.fault(Severity.FAULT2, a.cause))
        elif isinstance(a, DeclareDead):
            view = self.view
            for r in sorted(a.ranks):
                inc = view.incarnation(r) if view and r in view.ranks else 0
                fx.declared_dead(Member(r, inc), s.epoch)
                if inc:  # its exit notice, when the agent has killed it, is no new fault
                    self.dead.add(Member(r, inc))
                why = "silent: never arrived at the next epoch's formation"
                fx.broadcast(self.fault(Severity.FAULT1, why, r, inc))
        else:  # pragma: no cover - a new action without an effect
            raise AssertionError(f"no effect for {a}")

    def report(self, severity: Severity, cause: str, fx: Effects) -> None:
        """This worker's own fault: on the bus, and into the machine (the caller checked
        it was not :func:`superseded`)."""
        fx.broadcast(self.fault(severity, cause))
        self.feed(LocalFault(severity, cause[:200]), fx)

    def receive(self, m: Message, fx: Effects, finished: bool | None = None) -> Message | None:
        """A bus message: route it (:func:`.inbox.route`), keep it if early, feed its
        events; a drain ack or a joiner's answer to send is returned (the owner sends it).
        ``finished``: whether the job finished, if the owner asked the store already
        (outside its lock)."""
        if finished is None:
            r = fault_of(m)
            finished = r is not None and r.clean_exit and fx.job_finished()
        s = self.state
        out = route(
            m,
            me=self.me,
            view=self.view,
            epoch=s.epoch,
            step=s.step,
            dead=self.dead,
            finished=finished,
            world_size=self.world_size,
            leaving=s.leaving,
        )
        if out.early:
            self.early.append(m)
            return None
        if out.job_done and self.state.phase in (Phase.HEALING, Phase.INIT):
            self.finished = True
        if out.dead is not None:
            self.dead.add(out.dead)
        if out.record is not None:
            fx.record(*out.record)
        for ev in out.events:
            self.feed(ev, fx)
        if out.alive:  # (a joiner asks: the epoch lives, whatever its main threads do)
            return Heartbeat(**self.header())
        if out.ack_drain is None:
            return None
        return DrainAck(**self.header(), drained_rank=out.ack_drain)

    def replay_early(self, fx: Effects) -> None:
        """After adopting a view: route the early messages again (those of a later epoch
        still wait)."""
        kept, self.early = list(self.early), collections.deque(maxlen=EARLY_KEPT)
        for m in kept:
            ack = self.receive(m, fx)
            if ack is not None:
                fx.broadcast(ack)

    def adopt(self, view: EpochView, source: int | None, fx: Effects) -> None:
        """Enter ``view`` (``source``: who sends this member's state, if it heals apart)."""
        self.view = view
        ready = QuorumReady(
            view.epoch,
            view.ranks,
            view.step,
            view.needs_state,
            waiting=bool(view.waiting),
            source=source,
        )
        self.feed(ready, fx)
        for m in view.members:  # deaths heard of while the epoch was being formed
            if m in self.dead and m != self.me:
                self.feed(PeerFault(m.rank, Severity.FAULT1, "died during formation"), fx)
        self.replay_early(fx)  # a peer that adopted it first may be rolling it back

    # --- the main thread -------------------------------------------------------------------
    def next(self, done: Check, fx: Effects) -> Action | Wait:
        """The main thread's next action (:data:`JOIN` in INIT), or why it has none."""
        if self.finished and self.state.phase in (Phase.HEALING, Phase.INIT):
            self.todo.clear()
            return Wait.FINISHED
        while self.todo:
            queued, epoch, action = self.todo.popleft()
            why = stale(action, queued, epoch, self.phase_changes, self.state.epoch)
            if why:
                log.debug("dropping %s (stale: %s)", action, why)
                continue
            self.action_gen = queued
            return action
        s = self.state
        if done(s):
            return Wait.DONE
        if s.phase is Phase.EXIT:
            return Wait.LEFT
        now = self.clock()
        if s.phase is Phase.DRAIN_WAIT and now - self.phase_since > self.rollback_timeout_s:
            self.phase_since = now
            self.feed(Deadline(now), fx)
            return Wait.AGAIN
        if s.phase is Phase.INIT:
            self.action_gen = self.phase_changes
            return JOIN
        return Wait.IDLE

    @staticmethod
    def run(a: Action, main: MainThread[R]) -> R:
        """Perform a main-thread action through ``main``."""
        if a is JOIN:
            return main.join()
        if isinstance(a, CastVote):
            return main.vote(a)
        if isinstance(a, ApplyCommit):
            return main.commit(a)
        if isinstance(a, ZeroGrads):
            return main.zero_grads(a)
        if isinstance(a, FormEpoch):
            return main.form(a)
        if isinstance(a, ConfigureProcessGroup):
            return main.configure(a)
        if isinstance(a, FetchState | SendState):
            return main.heal(a, fetch=isinstance(a, FetchState))
        if isinstance(a, ExitWorker):
            return main.exit(a)
        raise AssertionError(f"no main-thread effect for {a}")  # pragma: no cover
