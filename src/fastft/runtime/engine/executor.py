"""The executor: feeds the state machine and performs its actions.

Events come from two threads: the bus listener (peers' faults, rollback requests, joins;
:mod:`.inbox` turns messages into events) and the main thread (the step finished, a local
exception, a decision read from the store). Both feed :meth:`Executor.feed`: it runs
:func:`fastft.fsm.decide` under one lock, performs the *immediate* actions on the spot
(interrupt the step, propose ROLLBACK, broadcast) and queues the rest (vote, apply the
commit, drop gradients, form the next epoch, build its group, heal) for the main thread
(:meth:`Executor.drive`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastft.fsm import (
    ApplyCommit,
    CastVote,
    CommitApplied,
    ConfigureProcessGroup,
    DeclareDead,
    Event,
    ExitWorker,
    FetchState,
    FormEpoch,
    GradsReady,
    HealDone,
    Phase,
    SendState,
    Shutdown,
    StateLoaded,
    StepState,
    ZeroGrads,
)
from fastft.interrupt import Interrupter, StepInterrupted
from fastft.process.events import EventLog
from fastft.process.services import Services
from fastft.protocol import JobKeys, Message, RollbackRequest, Severity
from fastft.runtime.contract import EpochView, Member, RuntimeConfig
from fastft.runtime.durable.checkpoints import Checkpoints
from fastft.runtime.durable.commit import CommitCheckpoints
from fastft.runtime.endings import FaultStorm, WorkerExit
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.core import Core, OnCore, Seen, Wait
from fastft.runtime.engine.effects import Immediate
from fastft.runtime.engine.faults import Faults
from fastft.runtime.engine.membership import Membership
from fastft.runtime.engine.queue import superseded
from fastft.runtime.engine.sideclient import SideClient
from fastft.runtime.groups.plane import Plane
from fastft.runtime.state.heal import Healer
from fastft.runtime.state.kept import KeptGradients, commit_fields
from fastft.runtime.state.registry import StateRegistry

__all__ = ["EngineParts", "Executor"]

log = logging.getLogger(__name__)

_WAIT_S = 0.05
Check = Callable[[StepState], bool]


@dataclass(frozen=True)
class EngineParts:
    """What an executor is built over, each part built with what it needs
    (:func:`~fastft.runtime.engine.build.build_engine`)."""

    coord: Coordinator
    side: SideClient
    """The listener thread's store client (rollback proposals, key collection)."""
    registry: StateRegistry
    interrupter: Interrupter
    events: EventLog
    plane: Plane
    kept: KeptGradients
    durable: Checkpoints | None = None
    """The durable tier (``--checkpoint-dir``), None without one."""
    after_commit: Callable[[int], None] | None = None
    """Called with the count of committed steps after each commit (pipeline stages)."""


class Executor(OnCore):
    """One per worker. ``state`` is the state machine's; ``view`` the current epoch.
    ``dead``: the worker's one set of lives known dead (its coordinator reads it)."""

    def __init__(
        self, config: RuntimeConfig, me: Member, parts: EngineParts, dead: set[Member]
    ) -> None:
        self.config = config
        self.durable = parts.durable
        self.after_commit = parts.after_commit
        self.suspect_state = False
        """An in-process restart left this worker's state in doubt: its next formation
        heals it from a member whose state is not (:class:`~.formation.Arrival`)."""
        self.me = me
        self.keys: JobKeys = parts.coord.keys
        self.coord = parts.coord
        self.side = parts.side
        self.registry = parts.registry
        self.interrupter = parts.interrupter
        self.events = events = parts.events
        self.dp = parts.plane
        self.kept = parts.kept
        self.core = Core(
            me,
            config.job,
            rollback_timeout_s=config.rollback_timeout_s,
            world_size=config.world_size,
            clock=time.monotonic,
            dead=dead,
        )
        """The engine's state and rules (:mod:`.core`); the lives known dead are the
        worker's one set (the coordinator it was built with reads it)."""
        self.services: Services | None = None
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.fx = Immediate(
            self.cond, self.interrupter, self.side, self.dp, events, lambda: self.sv
        )
        """The core's immediate actions, on the thread that fed the event (:mod:`.effects`)."""
        self.closing = False
        self.commits = 0
        self.rollbacks = 0
        self.recoveries = 0
        """Rollbacks since this worker's last commit (a fault storm past max_recoveries)."""
        self.membership = Membership(self)
        self.faults = Faults(self)
        self.checkpoints = CommitCheckpoints(self.durable, config, events, self.registry.state)

    def local_fault(self, exc: BaseException, gen: int | None = None) -> None:
        self.faults.local(exc, gen)

    def suspect(self, doubt: bool) -> None:
        with self.lock:
            self.suspect_state = doubt

    def attach(self, services: Services) -> None:
        self.services = services
        self.healer = Healer(
            self.dp, self.registry, self.interrupter, services.heartbeat, self.events
        )
        self.checkpoints.shield = lambda: services.heartbeat.blocked

    @property
    def sv(self) -> Services:
        assert self.services is not None
        return self.services

    # --- feeding ---------------------------------------------------------------------------
    def feed(self, event: Event) -> None:
        with self.lock:
            self.feed_locked(event)

    def feed_locked(self, event: Event) -> None:
        self.core.feed(event, self.fx)

    def shutdown(self, reason: str) -> None:
        """The worker closes: the machine ends, and the main thread stops waiting."""
        with self.lock:
            self.feed_locked(Shutdown(reason))
            self.cond.notify_all()

    def seen(self) -> Seen:
        """The engine now, read under the lock (a part never takes it)."""
        with self.lock:
            return Seen(self.state, self.view, self.phase_changes)

    def grads_ready(self, step: int, agreed: bool, confirm: bool = False) -> None:
        """Step ``step``'s gradients are ready (its collective ``agreed``, to ``confirm``
        in the store: :class:`~fastft.fsm.GradsReady`): fed unless a fault moved the
        machine on meanwhile."""
        with self.lock:
            s = self.state
            if s.phase is Phase.NORMAL and s.step == step:
                self.feed_locked(GradsReady(agreed=agreed, confirm=confirm))

    # (what the parts ask of the core: only the executor takes its lock)
    def adopt(self, view: EpochView, source: int | None) -> None:
        with self.lock:
            self.core.adopt(view, source, self.fx)

    def report(self, severity: Severity, cause: str, gen: int | None = None) -> None:
        """This worker's own fault (``gen``: the count of phase changes when the failed
        work began): superseded if the machine moved since (:func:`.queue.superseded`),
        else on the bus and into the machine."""
        with self.lock:
            s = self.state
            if superseded(gen, self.phase_changes, severity):
                self.events.emit("local_fault_superseded", step=s.step, cause=cause[:300])
                return
            self.events.emit(
                "local_fault",
                step=s.step,
                epoch=s.epoch,
                severity=severity.name,
                cause=cause[:500],
                incarnation=self.me.incarnation,
            )
            self.core.report(severity, cause, self.fx)

    def receive(self, m: Message, finished: bool | None = None) -> Message | None:
        with self.lock:
            return self.core.receive(m, self.fx, finished)

    def declare_silent(self, ranks: frozenset[int]) -> None:
        """Members that never arrived at a formation (:mod:`.survivors`)."""
        with self.lock:
            self.core.perform(DeclareDead(ranks), self.fx)

    def remind(self) -> None:
        """A rollback request to the members a formation misses (:mod:`.survivors`)."""
        s = self.state
        self.events.emit("remind", epoch=s.epoch, step=s.step)
        why = f"epoch {s.epoch + 1} is forming without you"
        self.sv.bus.broadcast(RollbackRequest(**self.core.header(), reason=why))

    # --- the main thread -------------------------------------------------------------------
    def drive(self, done: Check, *, settled: Check | None = None) -> None:
        """Main thread: run queued actions until ``done(state)``; return before the next
        one once ``settled(state)``: a step's exit returns at its commit, so what a fault
        queued meanwhile (a heal to send) runs after the script's post-commit code
        (docs/architecture.md, *The consistency point*)."""
        hb = self.sv.heartbeat
        if settled is None:  # (any other drive: the post-commit code has run)
            self.settle()
        while True:
            with self.lock:
                if settled is not None and settled(self.state):
                    return
                got = self.core.next(done, self.fx)
                if got is Wait.DONE:
                    return
                if got is Wait.LEFT:
                    raise WorkerExit(self.state.reason or "worker left the job")
                if got is Wait.AGAIN:
                    continue
                if got is Wait.FINISHED:
                    self.membership.finished_meanwhile()
                if got is Wait.IDLE:
                    hb.beat()
                    self.cond.wait(_WAIT_S)
                    continue
            hb.beat()
            Core.run(got, self)

    # (core.MainThread: the main thread's actions)
    def join(self) -> None:
        self.membership.join()

    def vote(self, a: CastVote) -> None:
        self.membership.vote(a)

    def form(self, a: FormEpoch) -> None:
        self.sv.heartbeat.unsettle()  # (a new world: its first step may compile again)
        self.membership.form(a)

    def zero_grads(self, a: ZeroGrads) -> None:
        self.registry.rollback()
        self.sv.heartbeat.unsettle()
        self.rollbacks += 1
        self.recoveries += 1
        s = self.state
        if self.recoveries > self.config.max_recoveries:
            why = (
                f"{self.recoveries} recoveries in a row without a committed step (the "
                f"last at step {s.step}: {s.reason}); a fault storm: stopping the job "
                "(--max-recoveries)"
            )
            self.events.emit("fault_storm", step=s.step, recoveries=self.recoveries)
            log.error("%s", why)
            raise FaultStorm(why)
        if self.dp.gate is not None:  # (shard groups: the mates that entered it go back)
            self.dp.gate.leave((s.epoch, s.step))
        self.events.emit("rollback", epoch=s.epoch, step=s.step, reason=s.reason)

    def exit(self, a: ExitWorker) -> None:
        self.events.emit("exit", reason=a.reason)
        if not self.closing:
            raise WorkerExit(a.reason)

    def cancelled(self, phase: Phase) -> Callable[[], bool]:
        """A check for long main-thread waits: true once the job closes or the state
        machine left ``phase``, even if it came back to it meanwhile (a fault during a
        formation or a process-group build queues a new one; the old wait is stale)."""
        changes = self.action_gen
        hb = self.sv.heartbeat

        def check() -> bool:
            hb.beat()
            return (
                self.closing
                or self.state.phase is not phase
                or self.phase_changes != changes
                or self.core.finished
            )

        return check

    def commit(self, a: ApplyCommit) -> None:
        self.sv.injector.fire_due(a.step, point="commit")  # tests: death after the decision
        opt = self.registry.optimizer
        with self.interrupter.atomic():
            self.registry.apply_average()  # (--sync every-k: a sync step's averages)
            if opt is not None:
                opt.step()
            self.registry.zero_grads()
            self.registry.committed()
        self.membership.applied(a.step)
        self.commits += 1
        self.sv.heartbeat.committed(clean=self.recoveries == 0)
        self.recoveries = 0
        if self.dp.heal_pg is not None:
            # every member voted: every heal of the epoch is over on both ends, the group goes
            self.dp.release_heal(pending=False)
        self.events.emit(
            "commit",
            epoch=self.state.epoch,
            step=a.step,
            wait_ms=self.membership.take_decision_wait(),
            **commit_fields(self.registry, self.kept, self.config.check_every, a.step),
        )
        if self.after_commit is not None:  # (after the commit event: see runtime.flow)
            self.after_commit(a.step + 1)
        s = self.state
        # a drain's commit is checkpointed: workers that leave may leave no holder
        self.checkpoints.committed(a.step + 1, force=s.want_drain or bool(s.leaving))
        self.feed(CommitApplied())

    def settle(self) -> None:
        """The script's post-commit code has run: the last commit's checkpoint, if due."""
        self.checkpoints.settle(self.view, self.me)

    def configure(self, a: ConfigureProcessGroup) -> None:
        view = self.view
        assert view is not None and view.epoch == a.epoch
        base = self.cancelled(self.state.phase)
        try:
            self.dp.configure(
                view,
                self.me.rank,
                self.keys.pg_prefix(a.epoch),
                lambda: base() or self.state.epoch != a.epoch,
            )
        except Exception as e:
            self.faults.local(e, gen=self.action_gen)

    def heal(self, a: FetchState | SendState, *, fetch: bool) -> None:
        view = self.view
        assert view is not None and view.source is not None
        if self.dp.pg is None or self.dp.pg_epoch != a.epoch:
            return  # the process group was not built (cancelled): the fsm moved on
        self.sv.injector.fire_due(a.step, point="heal")  # tests: death while healing
        try:
            got = self.healer.transfer(a.epoch, a.step, view, self.me.rank, fetch=fetch)
        except StepInterrupted:
            return
        except Exception as e:
            self.faults.local(e, gen=self.action_gen)
            return
        with self.lock:
            if got.tail is not None and not self.dp.hold_tail(got.tail):
                return  # a fault released the group (and ended the epoch) meanwhile
            self.feed_locked(HealDone(pending=got.tail is not None and got.receiving))

    def finish_heal_tail(self) -> None:
        """Before the vote (S4: no vote without the whole state); raises StepInterrupted
        on a fault meanwhile."""
        tail = self.dp.heal_tail
        if tail is None:
            return
        self.healer.finish_tail(tail)
        with self.lock:
            if not self.dp.drop_tail(tail):
                self.interrupter.check()  # released by a fault that ended the step
                return
            s = self.state
            if tail.receiving and s.phase is Phase.NORMAL and s.epoch == tail.epoch:
                self.feed_locked(StateLoaded())
