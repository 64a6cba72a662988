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

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fastft.fsm import (
    AbortProcessGroup,
    Action,
    ApplyCommit,
    BroadcastDrainNotice,
    CancelFutures,
    CastVote,
    CommitApplied,
    ConfigureProcessGroup,
    Deadline,
    DeclareDead,
    Event,
    ExitWorker,
    FetchState,
    FormEpoch,
    HealDone,
    InterruptStep,
    InvalidTransition,
    Phase,
    ProposeRollback,
    ReportFault,
    SendDrainAck,
    SendState,
    StateLoaded,
    StepState,
    ZeroGrads,
    decide,
    initial_state,
)
from fastft.interrupt import Interrupter, StepInterrupted
from fastft.process.events import EventLog
from fastft.process.services import Services
from fastft.protocol import (
    DrainAck,
    DrainNotice,
    Fault,
    JobKeys,
    RollbackRequest,
    Severity,
)
from fastft.runtime.contract import EpochView, Member, RuntimeConfig
from fastft.runtime.durable.checkpoints import Checkpoints
from fastft.runtime.durable.commit import CommitCheckpoints
from fastft.runtime.endings import FaultStorm, WorkerExit
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.faults import Faults
from fastft.runtime.engine.membership import Membership
from fastft.runtime.engine.sideclient import SideClient
from fastft.runtime.engine.todo import MAIN_ACTIONS, moved, stale
from fastft.runtime.groups.dataplane import DataPlane
from fastft.runtime.state.heal import Healer
from fastft.runtime.state.kept import KeptGradients, commit_fields
from fastft.runtime.state.registry import StateRegistry

__all__ = ["Executor"]

log = logging.getLogger(__name__)

_STEP_CYCLE = (Phase.NORMAL, Phase.PREPARED, Phase.COMMIT)
_WAIT_S = 0.05
_JOIN = Action()
Check = Callable[[StepState], bool]


class Executor:
    """One per worker. ``state`` is the state machine's; ``view`` the current epoch."""

    def __init__(
        self,
        config: RuntimeConfig,
        me: Member,
        coord: Coordinator,
        side: SideClient,
        registry: StateRegistry,
        interrupter: Interrupter,
        events: EventLog,
        dataplane: DataPlane,
        kept: KeptGradients,
        durable: Checkpoints | None = None,
        dead: set[Member] | None = None,
        *,
        after_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.durable = durable
        """The durable tier (``--checkpoint-dir``), None without one."""
        self.after_commit = after_commit
        """Called with the count of committed steps after each commit (pipeline stages)."""
        self.suspect_state = False
        """An in-process restart left this worker's state in doubt: its next formation
        heals it from a member whose state is not (:class:`~.formation.Arrival`)."""
        self.me = me
        self.keys: JobKeys = coord.keys
        self.coord = coord
        self.side = side
        """The listener thread's store client (rollback proposals, key collection)."""
        self.registry = registry
        self.interrupter = interrupter
        self.events = events
        self.dp = dataplane
        self.kept = kept
        self.dead: set[Member] = dead if dead is not None else set()
        """Lives known dead: the worker's one set, written here only (the coordinator
        it was built with reads it)."""
        self.services: Services | None = None
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.state: StepState = initial_state(me.rank)
        self.view: EpochView | None = None
        self.phase_changes = 0
        self._phase_since = time.monotonic()
        self.action_gen = 0
        self._todo: collections.deque[tuple[int, int, Action]] = collections.deque()
        """Main-thread actions with the phase changes and the epoch they were queued at."""
        self.closing = False
        self.commits = 0
        self.rollbacks = 0
        self.recoveries = 0
        """Rollbacks since this worker's last commit (a fault storm past max_recoveries)."""
        self.membership = Membership(self)
        self.faults = Faults(self)
        self.checkpoints = CommitCheckpoints(durable, config, events, registry.state)

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
        before = self.state
        try:
            new, actions = decide(before, event)
        except InvalidTransition as e:
            log.error("state machine: %s (ignored)", e)
            return
        self.state = new
        if moved(before, new, actions):
            self._phase_since = time.monotonic()
            self.phase_changes += 1
            if not (before.phase in _STEP_CYCLE and new.phase in _STEP_CYCLE):
                # the fault-free cycle NORMAL -> PREPARED -> COMMIT is logged as commits
                self.events.emit(
                    "phase",
                    frm=before.phase.name,
                    to=new.phase.name,
                    epoch=new.epoch,
                    step=new.step,
                    on=type(event).__name__,
                    reason=new.reason or None,
                )
        for a in actions:
            if isinstance(a, MAIN_ACTIONS):
                self._todo.append((self.phase_changes, new.epoch, a))
                continue
            try:
                self._run_immediate(a)
            except Exception as e:  # noqa: BLE001 - the transition's other actions must run
                # (a proposal's store call: without the formation after it this worker
                # waited in HEALING forever; every peer proposes too: the simulator)
                log.error("action %s failed: %s: %s", type(a).__name__, type(e).__name__, e)
                self.events.emit("action_failed", action=type(a).__name__, error=str(e)[:300])
        self.cond.notify_all()

    def header(self) -> dict[str, Any]:
        s = self.state
        return dict(
            job=self.config.job,
            epoch=s.epoch,
            rank=self.me.rank,
            incarnation=self.me.incarnation,
            step=s.step,
        )

    def replay_early(self) -> None:
        self.faults.replay_early()

    def declare_silent(self, ranks: frozenset[int]) -> None:
        """Members that never arrived at a formation (:mod:`.survivors`)."""
        with self.lock:
            self._run_immediate(DeclareDead(ranks))

    def remind(self) -> None:
        """A rollback request to the members a formation misses (:mod:`.survivors`)."""
        s = self.state
        self.events.emit("remind", epoch=s.epoch, step=s.step)
        why = f"epoch {s.epoch + 1} is forming without you"
        self.sv.bus.broadcast(RollbackRequest(**self.header(), reason=why))

    def _run_immediate(self, a: Action) -> None:
        s = self.state
        bus = self.sv.bus
        if isinstance(a, InterruptStep):
            if self.interrupter.interrupt(a.reason, epoch=s.epoch):
                self.events.emit("interrupt", epoch=s.epoch, step=s.step, reason=a.reason)
        elif isinstance(a, ProposeRollback):
            got = self.side.propose_rollback(a.epoch, a.step, a.reason)
            self.events.emit(
                "propose_rollback", epoch=a.epoch, step=a.step, reason=a.reason, decision=got[:1]
            )
        elif isinstance(a, AbortProcessGroup):
            self.sv.injector.fire_due(s.step, point="rollback")  # tests: death mid-rollback
            self.dp.abort(s.epoch)
        elif isinstance(a, CancelFutures):
            pass  # the interrupt already failed every pending future of the step
        elif isinstance(a, BroadcastDrainNotice):
            # (the step it committed, not its count: a member still PREPARED on it learns
            # from the notice that the decision was a commit)
            head = {**self.header(), "epoch": a.epoch, "step": a.step}
            bus.broadcast(DrainNotice(**head, reason=a.reason[:2000]))
        elif isinstance(a, SendDrainAck):
            bus.broadcast(DrainAck(**self.header(), drained_rank=a.rank))
        elif isinstance(a, ReportFault):  # (its own fault, again: see StepState.refault)
            self.events.emit("fault_again", epoch=a.epoch, step=s.step, cause=a.cause[:300])
            bus.broadcast(
                Fault(
                    **self.header(),
                    severity=Severity.FAULT2,
                    cause=a.cause[:2000],
                    faulty_rank=self.me.rank,
                    faulty_incarnation=self.me.incarnation,
                )
            )
        elif isinstance(a, DeclareDead):
            view = self.view
            for r in sorted(a.ranks):
                inc = view.incarnation(r) if view and r in view.ranks else 0
                self.events.emit("declare_dead", rank=r, incarnation=inc, epoch=s.epoch)
                if inc:  # its exit notice, when the agent has killed it, is no new fault
                    self.dead.add(Member(r, inc))
                bus.broadcast(
                    Fault(
                        **self.header(),
                        severity=Severity.FAULT1,
                        cause="silent: never arrived at the next epoch's formation",
                        faulty_rank=r,
                        faulty_incarnation=inc,
                    )
                )
        else:  # pragma: no cover - a new action without an executor
            raise AssertionError(f"no executor for {a}")

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
                queued, epoch, action = self._todo.popleft() if self._todo else (0, 0, None)
                why = action and stale(action, queued, epoch, self.phase_changes, self.state.epoch)
                if why:
                    log.debug("dropping %s (stale: %s)", action, why)
                    continue
                if action is None:
                    s = self.state
                    if done(s):
                        return
                    if s.phase is Phase.EXIT:
                        raise WorkerExit(s.reason or "worker left the job")
                    if (
                        s.phase is Phase.DRAIN_WAIT
                        and time.monotonic() - self._phase_since > self.config.rollback_timeout_s
                    ):
                        self._phase_since = time.monotonic()
                        self.feed_locked(Deadline(time.monotonic()))
                        continue
                    if s.phase is Phase.INIT:
                        action = _JOIN
                    else:
                        hb.beat()
                        self.cond.wait(_WAIT_S)
                        continue
                self.action_gen = queued if action is not _JOIN else self.phase_changes
            hb.beat()
            self.run_main_action(action)

    def run_main_action(self, a: Action) -> None:
        m = self.membership
        if a is _JOIN:
            m.join()
        elif isinstance(a, CastVote):
            m.vote(a)
        elif isinstance(a, ApplyCommit):
            self._apply_commit(a)
        elif isinstance(a, ZeroGrads):
            self.registry.rollback()
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
        elif isinstance(a, FormEpoch):
            m.form(a)
        elif isinstance(a, ConfigureProcessGroup):
            self._configure(a)
        elif isinstance(a, FetchState | SendState):
            self._heal(a)
        elif isinstance(a, ExitWorker):
            self.events.emit("exit", reason=a.reason)
            if not self.closing:
                raise WorkerExit(a.reason)
        else:  # pragma: no cover
            raise AssertionError(f"no executor for {a}")

    def cancelled(self, phase: Phase) -> Callable[[], bool]:
        """A check for long main-thread waits: true once the job closes or the state
        machine left ``phase``, even if it came back to it meanwhile (a fault during a
        formation or a process-group build queues a new one; the old wait is stale)."""
        changes = self.action_gen
        hb = self.sv.heartbeat

        def check() -> bool:
            hb.beat()
            return self.closing or self.state.phase is not phase or self.phase_changes != changes

        return check

    def _apply_commit(self, a: ApplyCommit) -> None:
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
        self.recoveries = 0
        if self.dp.heal_pg is not None:
            # every member voted: every heal of the epoch is over on both ends, the group goes
            self.dp.release_heal(pending=False)
        self.sv.heartbeat.tracking = True
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

    def _configure(self, a: ConfigureProcessGroup) -> None:
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

    def _heal(self, a: FetchState | SendState) -> None:
        view = self.view
        assert view is not None and view.source is not None
        if self.dp.pg is None or self.dp.pg_epoch != a.epoch:
            return  # the process group was not built (cancelled): the fsm moved on
        self.sv.injector.fire_due(a.step, point="heal")  # tests: death while healing
        try:
            got = self.healer.transfer(
                a.epoch, a.step, view, self.me.rank, fetch=isinstance(a, FetchState)
            )
        except StepInterrupted:
            return
        except Exception as e:
            self.faults.local(e, gen=self.action_gen)
            return
        with self.lock:
            if got.tail is not None:
                if self.dp.heal_pg is None or self.dp.heal_pg[0] != a.epoch:
                    return  # a fault released the group (and ended the epoch) meanwhile
                self.dp.heal_tail = got.tail
            self.feed_locked(HealDone(pending=got.tail is not None and got.receiving))

    def finish_heal_tail(self) -> None:
        """Before the vote (S4: no vote without the whole state); raises StepInterrupted
        on a fault meanwhile."""
        tail = self.dp.heal_tail
        if tail is None:
            return
        self.healer.finish_tail(tail)
        with self.lock:
            if self.dp.heal_tail is not tail:
                self.interrupter.check()  # released by a fault that ended the step
                return
            self.dp.heal_tail = None
            s = self.state
            if tail.receiving and s.phase is Phase.NORMAL and s.epoch == tail.epoch:
                self.feed_locked(StateLoaded())
