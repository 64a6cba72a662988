"""One simulated worker life: the executor's loop, its actions and its listener, run by the
scheduler in slices instead of threads.

Everything that decides is the real code: the engine's core
(:class:`fastft.runtime.engine.core.Core`: the state machine fed, the immediate actions
performed, the main thread's queue with its stale actions dropped, the inbox routing every
bus message, the table from action to what performs it) and the real
:class:`~fastft.runtime.engine.coordinator.Coordinator` (votes, decisions, arrivals, the
closing compare-and-set, :func:`~fastft.runtime.engine.formation.close_after` and
``close_first``) over the simulated store. A life is the core's two ports: its
:class:`~fastft.runtime.engine.core.Effects` and its
:class:`~fastft.runtime.engine.core.MainThread`, whose actions return the simulated seconds
until the life looks again. What is modelled: the main thread's waits (a slice polls where
the real thread blocks or sleeps), the collectives and process-group builds (a rendezvous
of the epoch's members), the heal (the receivers copy the source's state), the user's step
(a hash chain: the state after step ``s`` is a function of the state before it and the
step's batch) and the interrupter (a wait sees the fault that ends it).
"""

from __future__ import annotations

from typing import Any

from fastft.fsm import (
    Action,
    ApplyCommit,
    ConfigureProcessGroup,
    DeclareDead,
    Event,
    ExitWorker,
    FetchState,
    GradsReady,
    InvalidTransition,
    Phase,
    SendState,
    StepState,
    ZeroGrads,
)
from fastft.protocol import Message, RollbackRequest, Severity
from fastft.protocol.exits import EXIT_DRAINED, EXIT_FAULT_STORM
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine import decisions
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.core import Core, Wait
from fastft.runtime.engine.joiners import Joiners
from fastft.runtime.engine.queue import superseded
from fastft.runtime.engine.survivors import Survivors
from fastft.sim.ports import Host
from fastft.sim.replicas import compare
from fastft.sim.store import StoreDown
from fastft.sim.waits import RTT_S, Ended, Waits

__all__ = ["Ended", "Life"]

_DRIVE_S = 0.05  # the executor's condition wait (it also wakes on every event fed)
_POLL_S = 0.002  # the coordinator's polls


class Life(Waits):
    def __init__(self, w: Host, rank: int, inc: int) -> None:
        self.w = w
        self.me = Member(rank, inc)
        self.rank, self.inc = rank, inc
        self.core = Core(
            self.me,
            w.keys.job,
            rollback_timeout_s=w.opts.rollback_timeout_s,
            world_size=w.opts.world_size,
            clock=self.clock,
        )
        self.coord = Coordinator(
            w.store,
            w.keys,
            rank,
            inc,
            w.opts.world_size,
            w.opts.min_members,
            dead=self.core.dead,
            clock=self.clock,
            sleep=_no_sleep,
            recovery=w.recovery,
        )
        self.survivors = Survivors(self.coord)
        self.joiners = Joiners(self.coord)
        self.h = w.chain[0]  # a fresh process builds the model from the seed: step 0's
        self.held = 0
        self.alive = True
        self.frozen = False  # SIGSTOP, a GIL hang, or its node cut off
        self.frozen_at = 0.0
        self.born = w.now
        self.buffered: list[Message] = []
        self.interrupts = 0
        self.pc: tuple[Any, ...] = ("drive",)
        self.user: tuple[Any, ...] = ("top",)  # the user's loop: where drive() returns
        self.since = w.now  # when the current wait began
        self.fail_next: str | None = None  # an injected fault, raised by the next step
        self.recoveries = 0
        self.main_token = 0
        self.suspect = False
        self.slow = 1.0  # a straggler's factor (a slow fault)
        self.healed: dict[tuple[str, ...], int] = {}  # (the replica check's memory)
        self.retried: tuple[int, tuple[str, ...]] | None = None
        self.commits = 0
        self.ended_by = ""  # (its agent killed it: "hung", "fenced")

    def clock(self) -> float:
        return self.w.now

    def freeze(self) -> None:
        """A SIGSTOP, a GIL hang, or its node cut off: no thread of it runs from now (or
        from when it stopped, if it is stopped already)."""
        if not self.frozen:
            self.frozen, self.frozen_at = True, self.w.now

    def __repr__(self) -> str:
        return f"rank {self.rank}.{self.inc}"

    # --- the core's effects (either "thread") --------------------------------------------
    def feed(self, event: Event) -> None:
        self.core.feed(event, self)

    def transition(self, before: StepState, after: StepState, event: Event, moved: bool) -> None:
        self.w.trace(self, f"{type(event).__name__} {before.phase.name}->{after.phase.name}")

    def invalid(self, e: InvalidTransition) -> None:
        self.w.violation(f"{self}: the state machine has no row for this: {e}")

    def failed(self, action: Action, e: Exception) -> None:
        if not isinstance(e, StoreDown):  # (logged; the transition's other actions still run)
            raise e
        self.w.trace(self, f"action {type(action).__name__} failed: {e}")

    def woken(self) -> None:
        self.w.wake(self)

    def broadcast(self, m: Message) -> None:
        self.w.broadcast(self, m)

    def interrupt(self, reason: str, epoch: int, step: int) -> None:
        self.interrupts += 1

    def propose_rollback(self, epoch: int, step: int, reason: str) -> None:
        decisions.propose_rollback(self.w.store, self.w.keys, epoch, step, reason)

    def abort_group(self, epoch: int, step: int) -> None:
        self.interrupts += 1

    def cancel(self) -> None:
        self.interrupts += 1

    def declared_dead(self, who: Member, epoch: int) -> None:
        self.w.checks.declared_dead(self, who)

    def record(self, name: str, fields: dict[str, Any]) -> None:
        """The event log's records, in the trace (a replayed seed shows what was routed)."""
        self.w.trace(self, f"{name} {fields}")

    def job_finished(self) -> bool:
        return bool(self.w.store.value(self.w.keys.finished))

    def declare_silent(self, ranks: frozenset[int]) -> None:
        """:meth:`fastft.runtime.engine.executor.Executor.declare_silent`."""
        self.core.perform(DeclareDead(ranks), self)

    def remind(self) -> None:
        """:meth:`fastft.runtime.engine.executor.Executor.remind`."""
        why = f"epoch {self.state.epoch + 1} is forming without you"
        self.w.broadcast(self, RollbackRequest(**self.core.header(), reason=why))

    def enter(self, view: EpochView) -> None:
        members = ", ".join(f"{m.rank}.{m.incarnation}" for m in view.members)
        heal = f", heals {sorted(view.needs_state)} from {view.source}" if view.needs_state else ""
        self.w.trace(self, f"adopts epoch {view.epoch} ({members}{heal})")
        self.core.adopt(view, view.source, self)

    def on_message(self, m: Message) -> None:
        """The listener: the core routes the message and feeds its events (a store call
        that fails ends the callback there, as the bus endpoint logs and counts it)."""
        if self.frozen:
            self.buffered.append(m)
            return
        ack = self.core.receive(m, self)
        if ack is not None:
            self.w.broadcast(self, ack)

    def local_fault(self, severity: Severity, cause: str, gen: int | None) -> None:
        """:meth:`fastft.runtime.engine.faults.Faults.local`: superseded when the machine
        moved since the failed work began; else on the bus and into the machine."""
        if not superseded(gen, self.phase_changes, severity):
            self.core.report(severity, cause, self)

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
        got = self.core.next(self.done, self)
        if got is Wait.DONE:
            return self.user_next()
        if got is Wait.LEFT:
            raise Ended(1, self.state.reason or "worker left the job")
        if got is Wait.AGAIN:
            return 0.0
        if got is Wait.FINISHED:
            raise Ended(0, "the job finished while this worker re-formed")
        if got is Wait.IDLE:
            return self.wait(("drive",), _DRIVE_S)
        return Core.run(got, self)

    # (the core's MainThread; the waiting ones are in Waits)
    def commit(self, a: ApplyCommit) -> float:
        self.apply(a.step)
        return 0.0

    def zero_grads(self, a: ZeroGrads) -> float:
        self.recoveries += 1
        if self.recoveries > self.w.opts.max_recoveries:
            raise Ended(EXIT_FAULT_STORM, f"{self.recoveries} recoveries in a row")
        return 0.0

    def configure(self, a: ConfigureProcessGroup) -> float:
        return self.wait(("pg", a.epoch, self.action_gen), RTT_S)

    def heal(self, a: FetchState | SendState, *, fetch: bool) -> float:
        if self.w.built.get(self.me) != a.epoch:
            return 0.0  # the process group was not built (cancelled): the fsm moved on
        return self.wait(("heal", a.epoch, a.step, self.action_gen), RTT_S)

    def exit(self, a: ExitWorker) -> float:
        raise Ended(EXIT_DRAINED if a.reason == "drained" else 1, a.reason)

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
        return self.wait(("compute", s.epoch, s.step, gen, False), self.w.compute_s() * self.slow)

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
            w.snapshots.setdefault(key, {})[self.me] = self.h  # (what the check compares)
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
            # (only with flipped bits: the repair would hide the protocol's own defects,
            # S4's among them, which the simulator is for)
            repaired = compare(self, key, view, gen) if "bitflip" in w.opts.kinds else None
            if repaired == "fault":
                return self.back_to_drive()
            self.feed(GradsReady(agreed=agreed and repaired is None))
        self.user = ("decided", step)
        return self.back_to_drive()


def s_ok(s: StepState, epoch: int, step: int) -> bool:
    return s.phase is Phase.NORMAL and s.step == step and s.epoch == epoch


def _no_sleep(s: float) -> None:  # pragma: no cover - the simulator never lets it sleep
    raise AssertionError("a simulated coordinator never sleeps")
