"""One attempt of one step, as the runtime runs it: entering (the staleness bound's hold,
DiLoCo's outer step, the shard group's gate, the snapshot) and leaving (the vote, or what
an exception means). A mixin of :class:`fastft.runtime.api.Runtime`, apart so that each
module reads in one sitting."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from fastft.fsm import GradsReady, Phase, StepState
from fastft.interrupt import Interrupter, StepInterrupted
from fastft.interrupt import allreduce as interruptible_allreduce
from fastft.process.events import EventLog
from fastft.process.heartbeat import Heartbeat
from fastft.protocol.exits import EXIT_GROUP_FAULT
from fastft.runtime.contract import DataDiverged, RuntimeConfig, ScriptError, misuse
from fastft.runtime.groups.flow import hold_stage
from fastft.runtime.groups.sync import outer_due, outer_step
from fastft.runtime.state.data import Batches, batch_digest
from fastft.runtime.state.registry import StateRegistry, reseed

if TYPE_CHECKING:
    from fastft.inject.execute import Injector
    from fastft.runtime.api import Runtime
    from fastft.runtime.engine.executor import Executor
    from fastft.runtime.groups.flow import Flow
    from fastft.runtime.transaction import Transaction

__all__ = ["StepAttempts"]

log = logging.getLogger(__name__)


class StepAttempts:
    """The runtime's step entry and exit (see the module)."""

    _x: Executor
    config: RuntimeConfig
    registry: StateRegistry
    interrupter: Interrupter
    events: EventLog
    injector: Injector
    flow: Flow | None
    rank: int
    _hb: Heartbeat
    _registered: bool
    _batches: list[Batches]
    _retries: int
    _step_gen: int
    _gate_gen: int

    @property
    def sharded(self) -> bool:
        raise NotImplementedError

    @property
    def step(self) -> int:
        raise NotImplementedError

    def _drive(self, done: Callable[[StepState], bool]) -> None:
        raise NotImplementedError

    @property
    def _rt(self) -> Runtime:
        return cast("Runtime", self)

    def _enter(self, tx: Transaction) -> Transaction:
        if not self._registered:
            raise RuntimeError("call ft.register(model=..., optimizer=...) before a transaction")
        self._hb.between(False)
        x = self._x
        while not self._begin_attempt():
            pass
        s, view = x.state, x.view
        assert view is not None
        tx.step, tx.epoch = s.step, s.epoch
        tx.rank, tx.world = view.index(self.rank), len(view.members)
        x.kept.begin_attempt()
        reseed(self.config.seed, s.step, tx.rank)
        self.registry.begin_step()
        for batches in self._batches:
            batches.start_step()
        self._hb.beat()
        self.interrupter.begin_step(s.epoch, s.step)
        self._step_gen = x.phase_changes
        if self.sharded:  # FSDP's collectives inside the group finish; the reduce is interrupted
            self.interrupter.defer_s = self.config.rollback_timeout_s / 2
            if self._gate_gen != self._step_gen:  # a fault came after the gate: the mates run
                self._step_gen = self._gate_gen  # the body (FSDP pairs them); it then rolls back
                self.interrupter.interrupt("a fault as the step began", epoch=s.epoch, step=s.step)
        try:
            self.injector.fire_due(s.step)
        except Exception as e:  # an injected exception: a local fault of this step
            if self.sharded:
                self._group_fault(e)
            x.faults.local(e)
        return tx

    def _exit(self, tx: Transaction, et: Any, ev: Any) -> bool:
        x = self._x
        if et is None and x.dp.heal_tail is not None:
            try:
                x.finish_heal_tail()
            except (StepInterrupted, Exception) as e:  # as if the step's body had raised it
                et, ev = type(e), e
        if et is None and self._batches and tx.world > 1:
            try:
                self._check_batches(tx)  # (raises DataDiverged: the job ends)
            except (StepInterrupted, Exception) as e:  # as if the step's body had raised it
                et, ev = type(e), e
        self.interrupter.end_step()
        self._hb.beat()
        step = tx.step
        if et is None:
            with x.lock:
                if x.state.phase is Phase.NORMAL and x.state.step == step:
                    x.feed_locked(GradsReady())
            self._drive(
                lambda s: (
                    s.step != step
                    or s.phase not in (Phase.PREPARED, Phase.COMMIT, Phase.DRAIN_COMMIT)
                )
            )
            tx.committed = x.state.step > step
            if tx.committed:
                self._retries = 0
            return False
        if isinstance(ev, StepInterrupted):
            self.events.emit(
                "interrupted",
                epoch=tx.epoch,
                step=step,
                reason=ev.reason,
                source_rank=ev.source_rank,
            )
            return True
        why = misuse(ev) if isinstance(ev, Exception) else None
        if why is not None:  # no retry or restart can help: the job fails at once
            self.events.emit("script_error", step=step, error=why)
            log.critical("%s", why)
            raise ScriptError(why) from ev
        if isinstance(ev, Exception) and self.sharded:
            if x.phase_changes == self._step_gen:  # (else a consequence of a known fault)
                self._group_fault(ev)
            x.faults.local(ev, gen=self._step_gen)
            return True
        if isinstance(ev, Exception):
            self._retries += 1
            x.faults.local(ev, gen=self._step_gen)
            if self._retries > self.config.max_step_retries:
                log.error("step %d failed %d times in a row: giving up", step, self._retries)
                return False
            return True
        return False  # KeyboardInterrupt, SystemExit, ...

    def _check_batches(self, tx: Transaction) -> None:
        """Whether every member drew the same batches in this attempt: one allreduce (max)
        of (digest, -digest) over the epoch, equal on every member, so that all of them
        see a difference at once. No loader quirk may train silently on the wrong data
        (:mod:`fastft.runtime.state.data`)."""
        mine = batch_digest(tuple(-1 if b.digest is None else b.digest for b in self._batches))
        both = torch.tensor([mine, -mine], dtype=torch.int64, device=self._x.dp.comm_device())
        with self._hb.blocked:
            interruptible_allreduce(
                self._rt._require_pg(),
                [both],
                self.interrupter,
                op=dist.ReduceOp.MAX,  # type: ignore[arg-type]
            )
        top, low = int(both[0]), -int(both[1])
        if top == low:
            return
        why = (
            f"the members of epoch {tx.epoch} drew different batches in step {tx.step} "
            f"(batch digests from {low:#x} to {top:#x}; this member's {mine:#x}): the "
            "data loader's order is not a function of its state on every member (a loader "
            "restored differently, a shuffle seeded per process); the step is not committed "
            "and the job stops rather than train on the wrong data"
        )
        self.events.emit("data_diverged", epoch=tx.epoch, step=tx.step, error=why)
        log.critical("%s", why)
        raise DataDiverged(why)

    def _begin_attempt(self) -> bool:
        """Wait for a step to attempt; run DiLoCo's outer step when it begins one, then
        cross the shard group's gate. False: a fault came first; wait for the next."""
        x = self._x
        self._drive(lambda s: s.phase is Phase.NORMAL)
        if self.flow is not None and not hold_stage(self._rt):
            return False  # (the staleness bound held it; a fault came first)
        ok = True
        if outer_due(self._rt, x.state.step):
            with x.lock:
                epoch, step, self._step_gen = x.state.epoch, x.state.step, x.phase_changes
            self.interrupter.begin_step(epoch, step)
            try:
                outer_step(self._rt)
            except StepInterrupted as e:
                self.events.emit("interrupted", epoch=epoch, step=step, reason=e.reason)
                ok = False
            except Exception as e:  # (the peers learn of it; the step rolls back)
                if self.sharded:
                    self._group_fault(e)
                x.faults.local(e, gen=self._step_gen)
                ok = False
            finally:
                self.interrupter.end_step()
        if x.dp.gate is not None:
            return self._cross_gate(ok)  # (a member that failed above says no)
        if not ok:  # wait for the rollback, which undoes the outer step
            self._drive(lambda s: s.phase is not Phase.NORMAL or (s.epoch, s.step) != (epoch, step))
        return ok

    def _cross_gate(self, ok: bool = True) -> bool:
        """Shard groups: whether every group mate enters this attempt too (StepGate); if
        not, wait for the fault a mate knew of, the rollback, and the next attempt."""
        x = self._x
        assert x.dp.gate is not None
        with x.lock:
            attempt = (x.state.epoch, x.state.step)
            go = ok and x.state.phase is Phase.NORMAL
            self._gate_gen = x.phase_changes
        if x.dp.gate.cross(attempt, go) and go:
            return True
        self._drive(lambda s: s.phase is not Phase.NORMAL or (s.epoch, s.step) != attempt)
        self._drive(lambda s: s.phase is Phase.NORMAL)
        return False

    def _group_fault(self, e: BaseException) -> None:
        """A member of a shard group raised inside its step: its group mates may be inside
        an FSDP collective with it, which Gloo cannot abort. It ends; its agent restarts
        the group, which heals from the other groups (a Fault1 of the group)."""
        log.error("rank %d raised in step %d; its group restarts", self.rank, self.step, exc_info=e)
        self.events.emit("group_fault", step=self.step, error=repr(e)[:300])
        self.events.close()
        os._exit(EXIT_GROUP_FAULT)
