"""One simulated worker life: the executor's loop, its actions and its listener, run by the
scheduler in slices instead of threads.

Everything that decides is the real code: :func:`fastft.fsm.decide` for every event,
:func:`fastft.runtime.engine.inbox.route` for every bus message,
:func:`fastft.runtime.engine.todo.stale` for the main thread's queue, and the real
:class:`~fastft.runtime.engine.coordinator.Coordinator` (votes, decisions, arrivals, the
closing compare-and-set, :func:`~fastft.runtime.engine.formation.close_after` and
``close_first``) over the simulated store. What is modelled: the main thread's waits
(a slice polls where the real thread blocks or sleeps), the collectives and process-group
builds (a rendezvous of the epoch's members), the heal (the receivers copy the source's
state), the user's step (a hash chain: the state after step ``s`` is a function of the
state before it and the step's batch) and the interrupter (a wait sees the fault that ends
it). A slice returns the simulated seconds until the life's next slice.
"""

from __future__ import annotations

import collections
from typing import Any

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
    GradsReady,
    InterruptStep,
    InvalidTransition,
    LocalFault,
    Phase,
    ProposeRollback,
    ReportFault,
    SendDrainAck,
    SendState,
    StepState,
    ZeroGrads,
    decide,
    initial_state,
)
from fastft.protocol import (
    DrainAck,
    DrainNotice,
    Fault,
    Message,
    RollbackRequest,
    Severity,
)
from fastft.protocol.exits import EXIT_DRAINED, EXIT_FAULT_STORM
from fastft.protocol.faults import fault_of
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine import decisions
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.inbox import route
from fastft.runtime.engine.survivors import Survivors
from fastft.runtime.engine.todo import MAIN_ACTIONS, moved, stale, superseded
from fastft.sim.ports import Host
from fastft.sim.store import StoreDown
from fastft.sim.waits import RTT_S, Ended, Waits

__all__ = ["Ended", "Life"]

_JOIN = Action()
_DRIVE_S = 0.05  # the executor's condition wait (it also wakes on every event fed)
_POLL_S = 0.002  # the coordinator's polls


class Life(Waits):
    def __init__(self, w: Host, rank: int, inc: int) -> None:
        self.w = w
        self.me = Member(rank, inc)
        self.rank, self.inc = rank, inc
        self.state: StepState = initial_state(rank)
        self.view: EpochView | None = None
        self.dead: set[Member] = set()
        self.todo: collections.deque[tuple[int, int, Action]] = collections.deque()
        self.phase_changes = 0
        self.action_gen = 0
        self.phase_since = w.now
        self.coord = Coordinator(
            w.store,
            w.keys,
            rank,
            inc,
            w.opts.world_size,
            w.opts.min_members,
            dead=self.dead,
            clock=self.clock,
            sleep=_no_sleep,
            recovery=w.recovery,
        )
        self.survivors = Survivors(self.coord)
        self.h = w.chain[0]  # a fresh process builds the model from the seed: step 0's
        self.held = 0
        self.alive = True
        self.frozen = False  # SIGSTOP, a GIL hang, or its node cut off
        self.buffered: list[Message] = []
        self.early: list[Message] = []  # (fastft.runtime.engine.faults.Faults.early)
        self.interrupts = 0
        self.pc: tuple[Any, ...] = ("drive",)
        self.user: tuple[Any, ...] = ("top",)  # the user's loop: where drive() returns
        self.since = w.now  # when the current wait began
        self.fail_next: str | None = None  # an injected fault, raised by the next step
        self.recoveries = 0
        self.main_token = 0
        self.suspect = False

    def clock(self) -> float:
        return self.w.now

    def __repr__(self) -> str:
        return f"rank {self.rank}.{self.inc}"

    # --- feeding (either "thread") ------------------------------------------------------
    def feed(self, event: Event) -> None:
        before = self.state
        try:
            new, actions = decide(before, event)
        except InvalidTransition as e:
            self.w.violation(f"{self}: the state machine has no row for this: {e}")
            return
        self.state = new
        if moved(before, new, actions):
            self.phase_since = self.w.now
            self.phase_changes += 1
        self.w.trace(self, f"{type(event).__name__} {before.phase.name}->{new.phase.name}")
        for a in actions:
            if isinstance(a, MAIN_ACTIONS):
                self.todo.append((self.phase_changes, new.epoch, a))
                continue
            try:
                self.immediate(a)
            except StoreDown as e:  # (logged; the transition's other actions still run)
                self.w.trace(self, f"action {type(a).__name__} failed: {e}")
        self.w.wake(self)

    def header(self) -> dict[str, Any]:
        s = self.state
        return dict(
            job=self.w.keys.job, epoch=s.epoch, rank=self.rank, incarnation=self.inc, step=s.step
        )

    def immediate(self, a: Action) -> None:
        w = self.w
        if isinstance(a, InterruptStep):
            self.interrupts += 1
        elif isinstance(a, ProposeRollback):
            decisions.propose_rollback(w.store, w.keys, a.epoch, a.step, a.reason)
        elif isinstance(a, AbortProcessGroup | CancelFutures):
            self.interrupts += 1
        elif isinstance(a, BroadcastDrainNotice):
            head = {**self.header(), "epoch": a.epoch, "step": a.step}
            w.broadcast(self, DrainNotice(**head, reason=a.reason[:2000]))
        elif isinstance(a, SendDrainAck):
            w.broadcast(self, DrainAck(**self.header(), drained_rank=a.rank))
        elif isinstance(a, ReportFault):
            fault = Fault(
                **self.header(),
                severity=Severity.FAULT2,
                cause=a.cause,
                faulty_rank=self.rank,
                faulty_incarnation=self.inc,
            )
            w.broadcast(self, fault)
        elif isinstance(a, DeclareDead):
            view = self.view
            for r in sorted(a.ranks):
                inc = view.incarnation(r) if view and r in view.ranks else 0
                w.checks.declared_dead(self, Member(r, inc))
                if inc:
                    self.dead.add(Member(r, inc))
                fault = Fault(
                    **self.header(),
                    severity=Severity.FAULT1,
                    cause="silent: never arrived at the next epoch's formation",
                    faulty_rank=r,
                    faulty_incarnation=inc,
                )
                w.broadcast(self, fault)
        else:  # pragma: no cover
            raise AssertionError(f"no executor for {a}")

    def declare_silent(self, ranks: frozenset[int]) -> None:
        """:meth:`fastft.runtime.engine.executor.Executor.declare_silent`."""
        self.immediate(DeclareDead(ranks))

    def remind(self) -> None:
        """:meth:`fastft.runtime.engine.executor.Executor.remind`."""
        why = f"epoch {self.state.epoch + 1} is forming without you"
        self.w.broadcast(self, RollbackRequest(**self.header(), reason=why))

    def on_message(self, m: Message) -> None:
        """The listener: route the message, feed its events (a store call that fails ends
        the callback there, as the bus endpoint logs and counts it)."""
        if self.frozen:
            self.buffered.append(m)
            return
        r = fault_of(m)
        finished = r is not None and r.clean_exit and self.w.store.value(self.w.keys.finished)
        s = self.state
        out = route(
            m,
            me=self.me,
            view=self.view,
            epoch=s.epoch,
            step=s.step,
            dead=self.dead,
            finished=bool(finished),
            world_size=self.w.opts.world_size,
            leaving=s.leaving,
        )
        if out.early:
            self.early.append(m)
            return
        if out.dead is not None:
            self.dead.add(out.dead)
        for ev in out.events:
            self.feed(ev)
        if out.ack_drain is not None:
            self.w.broadcast(self, DrainAck(**self.header(), drained_rank=out.ack_drain))

    def local_fault(self, severity: Severity, cause: str, gen: int | None) -> None:
        """:meth:`fastft.runtime.engine.faults.Faults.local`: superseded when the machine
        moved since the failed work began; else on the bus and into the machine."""
        if superseded(gen, self.phase_changes, severity):
            return
        fault = Fault(
            **self.header(),
            severity=severity,
            cause=cause,
            faulty_rank=self.rank,
            faulty_incarnation=self.inc,
        )
        self.w.broadcast(self, fault)
        self.feed(LocalFault(severity, cause))

    # --- the main thread ------------------------------------------------------------------
    def slice(self) -> float:
        """Run the main thread until it would wait; the seconds until it looks again."""
        kind = self.pc[0]
        if kind == "drive":
            return self.drive()
        return getattr(self, "_" + kind)(*self.pc[1:])

    def wait(self, pc: tuple[Any, ...], delay: float) -> float:
        if pc[0] != self.pc[0]:
            self.since = self.w.now
        self.pc = pc
        return delay

    def back_to_drive(self) -> float:
        self.pc = ("drive",)
        return 0.0

    def done(self, s: StepState) -> bool:
        if self.user[0] == "top":
            return s.phase is Phase.NORMAL
        step = self.user[1]
        return s.step != step or s.phase not in (Phase.PREPARED, Phase.COMMIT)

    def drive(self) -> float:
        while self.todo:
            queued, epoch, action = self.todo.popleft()
            why = stale(action, queued, epoch, self.phase_changes, self.state.epoch)
            if why:
                continue
            self.action_gen = queued
            return self.run(action)
        s = self.state
        if self.done(s):
            return self.user_next()
        if s.phase is Phase.EXIT:
            raise Ended(1, s.reason or "worker left the job")
        if (
            s.phase is Phase.DRAIN_WAIT
            and self.w.now - self.phase_since > self.w.opts.rollback_timeout_s
        ):
            self.phase_since = self.w.now
            self.feed(Deadline(self.w.now))
            return 0.0
        if s.phase is Phase.INIT:
            self.action_gen = self.phase_changes
            return self.run(_JOIN)
        return self.wait(("drive",), _DRIVE_S)

    def run(self, a: Action) -> float:
        if a is _JOIN:
            return self.join_start()
        if isinstance(a, CastVote):
            return self.vote_start(a)
        if isinstance(a, ApplyCommit):
            self.apply(a.step)
            return 0.0
        if isinstance(a, ZeroGrads):
            self.recoveries += 1
            if self.recoveries > self.w.opts.max_recoveries:
                raise Ended(EXIT_FAULT_STORM, f"{self.recoveries} recoveries in a row")
            return 0.0
        if isinstance(a, FormEpoch):
            return self.form_start(a)
        if isinstance(a, ConfigureProcessGroup):
            return self.wait(("pg", a.epoch, self.action_gen), RTT_S)
        if isinstance(a, FetchState | SendState):
            if self.w.built.get(self.me) != a.epoch:
                return 0.0  # the process group was not built (cancelled): the fsm moved on
            return self.wait(("heal", a.epoch, a.step, self.action_gen), RTT_S)
        if isinstance(a, ExitWorker):
            raise Ended(EXIT_DRAINED if a.reason == "drained" else 1, a.reason)
        raise AssertionError(f"no executor for {a}")  # pragma: no cover

    # the user's loop: drive(NORMAL); the step; GradsReady; drive(decided)
    def user_next(self) -> float:
        s = self.state
        if self.user[0] == "decided":
            self.user = ("top",)
            if self.fail_next == "escape":  # (its traceback, on_fault, the health checks)
                self.fail_next = None
                return self.wait(("restart",), self.w.compute_s())
            return 0.0
        if s.step >= self.w.opts.steps:
            self.w.finish(self)
            raise Ended(0, "finished")
        self.interrupts_at = self.interrupts
        gen = self.phase_changes
        return self.wait(("compute", s.epoch, s.step, gen, False), self.w.compute_s())

    def _restart(self) -> float:
        """:meth:`fastft.runtime.restart.Restartable._restart`: an exception escaped the
        user's loop after a step (an evaluation); the worker reports a fault of no step
        (whatever its machine is doing: a peer's fault may be rolling back or re-forming
        the epoch already) with its state suspect, and drives to NORMAL again."""
        view = self.view
        self.suspect = view is not None and len(view.members) > 1
        self.local_fault(Severity.FAULT2, "RuntimeError: escaped the loop (restart)", None)
        return self.back_to_drive()

    def _compute(self, epoch: int, step: int, gen: int, arrived: bool) -> float:
        w = self.w
        if self.interrupts != self.interrupts_at:
            return self.back_to_drive()  # StepInterrupted: the attempt ends, drive again
        if self.fail_next in ("exception", "state_lost"):
            kind, self.fail_next = self.fail_next, None
            if kind == "state_lost":
                self.h = f"lost@{w.now:.6f}"
                self.local_fault(Severity.FAULT1, "StateLostFault: injected", gen)
            else:
                self.local_fault(Severity.FAULT2, "RuntimeError: injected", gen)
            return self.back_to_drive()
        key = (epoch, step)
        if not arrived:
            w.collectives.setdefault(key, set()).add(self.me)
            if self.state.want_drain or self.state.joining:
                w.flagged.add(key)
        view = self.view
        assert view is not None
        there = w.collectives[key]
        done = w.completed.setdefault(key, set())
        # Every member must reach the step's collective (the gradients' and the decision's,
        # one here), and a member that contributed may still die before it passed on what
        # a peer needs: a peer that had not completed it then fails it while those that
        # had completed commit (a decision by the collective: docs/architecture.md).
        waiting = [m for m in view.members if m not in there or m not in done]
        if any(not w.lives[m].alive for m in waiting if m in w.lives and m != self.me):
            # Gloo: a peer's socket closed: the collective raises
            self.local_fault(Severity.FAULT2, "RuntimeError: peer closed", gen)
            return self.back_to_drive()
        stopped = any(w.lives[m].frozen for m in waiting if m in w.lives and m != self.me)
        if stopped or any(m not in there for m in view.members):  # (a frozen peer blocks it)
            return self.wait(("compute", epoch, step, gen, True), RTT_S)
        done.add(self.me)
        if s_ok(self.state, epoch, step):
            agreed = w.opts.decide == "collective" and key not in w.flagged
            self.feed(GradsReady(agreed=agreed))
        self.user = ("decided", step)
        return self.back_to_drive()


def s_ok(s: StepState, epoch: int, step: int) -> bool:
    return s.phase is Phase.NORMAL and s.step == step and s.epoch == epoch


def _no_sleep(s: float) -> None:  # pragma: no cover - the simulator never lets it sleep
    raise AssertionError("a simulated coordinator never sleeps")
