"""One attempt of one step, as the runtime runs it: entering (the staleness bound's hold,
DiLoCo's outer step, the shard group's gate, the snapshot) and leaving (the vote, or what
an exception means). :class:`StepAttempts` owns the attempt's own state (retries in a row,
the phase changes an attempt began at, the registered batches to compare) and uses the
runtime through its ports (:class:`~fastft.runtime.ports.RuntimePorts`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fastft.fsm import Phase
from fastft.interrupt import CollectiveFailed, StepInterrupted
from fastft.process.teardown import exit_now
from fastft.protocol.exits import EXIT_GROUP_FAULT
from fastft.runtime.agreement import Agreement, script_error
from fastft.runtime.endings import (
    misuse,
    repeated,
    signature,
)
from fastft.runtime.groups.flow import POLL_S
from fastft.runtime.state.rng import reseed
from fastft.runtime.sync import outer_due, outer_step

if TYPE_CHECKING:
    from fastft.runtime.ports import RuntimePorts
    from fastft.runtime.transaction import Transaction

__all__ = ["StepAttempts"]

log = logging.getLogger(__name__)


class StepAttempts:
    """The runtime's step entry and exit (see the module)."""

    def __init__(self, rt: RuntimePorts) -> None:
        self.rt = rt
        self.agreement = Agreement(rt)
        """The step's collective after its gradients (the vote's, the replica check's)."""
        self.retries = 0
        self.raised: tuple[int, tuple[str, str, str]] | None = None
        """The step and the error its last attempt raised, if the script's kind of error
        (:func:`~fastft.runtime.endings.signature`): the same again in its retry stops it."""
        """Attempts of the current step that raised, in a row."""
        self.step_gen = 0
        """The engine's phase changes when the current attempt began."""
        self.gate_gen = 0
        """... when it crossed the shard group's gate."""
        self._schedulers_checked = False

    def enter(self, tx: Transaction) -> Transaction:
        if not self.rt.registered:
            raise RuntimeError("call ft.register(model=..., optimizer=...) before a transaction")
        if not self._schedulers_checked:  # (a scheduler built after ft.register)
            self._schedulers_checked = True
            try:
                self.rt.registry.check_schedulers()
            except TypeError as e:
                self._script_error(self.rt.step, str(e), e)
        self.rt.heartbeat.between(False)
        x = self.rt.engine
        while True:
            while not self._begin_attempt():
                pass
            # the attempt's step and the count of phase changes it began at, read together
            # (a fault may land between the wait above and this read: wait again). A shard
            # group's member crossed its gate with its mates, who run the body now: it runs
            # it too, and the gate's own check below interrupts it (FSDP pairs them)
            now = x.seen()
            if now.state.phase is Phase.NORMAL or self.rt.sharded or x.dp.gate is not None:
                break
        s, view, gen = now.state, now.view, now.phase_changes
        assert view is not None
        tx.step, tx.epoch = s.step, s.epoch
        tx.rank, tx.world = view.index(self.rt.rank), len(view.members)
        x.kept.begin_attempt()
        if self.rt.config.reseed:  # (fastft.init(reseed=False): the script seeds its own)
            reseed(self.rt.config.seed, s.step, tx.rank)
        self.rt.registry.begin_step()
        compare = self.agreement.begin(s.epoch, s.step, tx.world)
        verified = self.rt.registry.verified  # (what a mismatch's repair goes back to)
        if compare and (s.step % self.rt.config.compare_every == 0 or verified.step is None):
            # the periodic checks only, once there is a copy: an epoch's first two steps
            # follow every recovery, and a copy there would lengthen each one (seconds of
            # a large model's state)
            verified.hold(self.rt.registry, s.step)
        for batches in self.agreement.batches:
            batches.start_step()
        self.rt.heartbeat.beat()
        self.rt.interrupter.begin_step(s.epoch, s.step)
        self.step_gen = gen
        if self.rt.sharded:  # FSDP's collectives inside the group finish; the reduce is interrupted
            self.rt.interrupter.defer(self.rt.config.rollback_timeout_s / 2)
            if self.gate_gen != self.step_gen:  # a fault came after the gate: the mates run
                self.step_gen = self.gate_gen  # the body (FSDP pairs them); it then rolls back
                self.rt.interrupter.interrupt(
                    "a fault as the step began", epoch=s.epoch, step=s.step
                )
        self._armed_late(s.epoch, s.step, gen)  # (after the deferral: a shard group's too)
        try:
            self.rt.injector.fire_due(s.step)
        except Exception as e:  # an injected exception: a local fault of this step
            if self.rt.sharded:
                self._group_fault(e)
            x.local_fault(e)
        return tx

    def exit(self, tx: Transaction, et: Any, ev: Any) -> bool:
        x = self.rt.engine
        if et is None and x.dp.heal_tail is not None:
            try:
                x.finish_heal_tail()
            except (StepInterrupted, Exception) as e:  # as if the step's body had raised it
                et, ev = type(e), e
        agreed = False
        if et is None:
            changed = self.rt.registry.changed_parameters()
            if changed is not None:
                self._script_error(
                    tx.step,
                    f"parameter {changed!r} was changed in place inside step {tx.step}'s "
                    "transaction: a rollback cannot undo that, and a retry would change it "
                    "twice. Change parameters through the registered optimizer (the "
                    "commit applies it), or under `if tx.committed:` after the step",
                )
            try:
                agreed = self.agreement.run(tx)  # (raises DataDiverged: the job ends)
            except (StepInterrupted, Exception) as e:  # as if the step's body had raised it
                et, ev = type(e), e
        self.rt.interrupter.end_step()
        self.rt.heartbeat.beat()
        step = tx.step
        if et is None:
            x.grads_ready(step, agreed, confirm=agreed and self.agreement.late())
            self.rt.drive(
                lambda s: (
                    s.step != step
                    or s.phase not in (Phase.PREPARED, Phase.COMMIT, Phase.DRAIN_COMMIT)
                ),
                # committed: the script's post-commit code runs before anything a fault
                # queued meanwhile (a heal sends the state after it)
                settled=lambda s: s.step != step,
            )
            tx.committed = x.state.step > step
            if tx.committed:
                self.retries = 0
                self.agreement.contact = time.monotonic()  # (every member was there)
            return False
        if isinstance(ev, StepInterrupted):
            self.rt.events.emit(
                "interrupted",
                epoch=tx.epoch,
                step=step,
                reason=ev.reason,
                source_rank=ev.source_rank,
            )
            return True
        why = misuse(ev) if isinstance(ev, Exception) else None
        if why is not None:  # no retry or restart can help: the job fails at once
            self._script_error(step, why, ev)
        sig = signature(ev) if isinstance(ev, Exception) else None
        if sig is not None and self.raised == (step, sig):  # (the retry raised it again)
            self._script_error(step, repeated(sig, step), ev)
        self.raised = (step, sig) if sig is not None else None
        # A collective of fastft's own that failed (a peer's connection closed: its death,
        # whose notice is on the way) is no fault of this group: it entered every one of
        # its group's collectives and lives on, so it rolls back as any member does.
        if isinstance(ev, Exception) and self.rt.sharded and not isinstance(ev, CollectiveFailed):
            if x.phase_changes == self.step_gen:  # (else a consequence of a known fault)
                self._group_fault(ev)
            x.local_fault(ev, gen=self.step_gen)
            return True
        if isinstance(ev, Exception):
            self.retries += 1
            x.local_fault(ev, gen=self.step_gen)
            if self.retries > self.rt.config.max_step_retries:
                log.error("step %d failed %d times in a row: giving up", step, self.retries)
                return False
            return True
        return False  # KeyboardInterrupt, SystemExit, ...

    def _armed_late(self, epoch: int, step: int, gen: int) -> None:
        """A fault that moved the machine on after the attempt began (``gen``) and before
        its step was armed: its interrupt found nothing to interrupt and was dropped. The
        step is interrupted now, before its first collective, rather than running into the
        fault's broken group (a dead peer's reset connection then failed it as this
        worker's own fault, another rollback cycle: a hung peer would hold it until
        Gloo's timeout)."""
        x = self.rt.engine
        if x.phase_changes == gen:  # (the usual case: one int read, no lock)
            return
        st = x.seen().state
        if st.phase is not Phase.NORMAL or (st.epoch, st.step) != (epoch, step):
            self.rt.interrupter.interrupt("a fault as the step began", epoch=epoch, step=step)

    def _script_error(self, step: int, why: str, cause: BaseException | None = None) -> None:
        script_error(self.rt, step, why, cause)

    def _begin_attempt(self) -> bool:
        """Wait for a step to attempt; run DiLoCo's outer step when it begins one, then
        cross the shard group's gate. False: a fault came first; wait for the next."""
        x = self.rt.engine
        self.rt.drive(lambda s: s.phase is Phase.NORMAL)
        if self.rt.flow is not None and not hold_stage(self.rt):
            return False  # (the staleness bound held it; a fault came first)
        ok = True
        if outer_due(self.rt, x.state.step):
            now = x.seen()
            epoch, step, self.step_gen = now.state.epoch, now.state.step, now.phase_changes
            self.rt.interrupter.begin_step(epoch, step)
            try:
                outer_step(self.rt)
            except StepInterrupted as e:
                self.rt.events.emit("interrupted", epoch=epoch, step=step, reason=e.reason)
                ok = False
            except Exception as e:  # (the peers learn of it; the step rolls back)
                if self.rt.sharded:
                    self._group_fault(e)
                x.local_fault(e, gen=self.step_gen)
                ok = False
            finally:
                self.rt.interrupter.end_step()
        if x.dp.gate is not None:
            return self._cross_gate(ok)  # (a member that failed above says no)
        if not ok:  # wait for the rollback, which undoes the outer step
            self.rt.drive(
                lambda s: s.phase is not Phase.NORMAL or (s.epoch, s.step) != (epoch, step)
            )
        return ok

    def _cross_gate(self, ok: bool = True) -> bool:
        """Shard groups: whether every group mate enters this attempt too (StepGate); if
        not, wait for the fault a mate knew of, the rollback, and the next attempt."""
        x = self.rt.engine
        assert x.dp.gate is not None
        now = x.seen()
        attempt = (now.state.epoch, now.state.step)
        go = ok and now.state.phase is Phase.NORMAL
        self.gate_gen = now.phase_changes
        if x.dp.gate.cross(attempt, go) and go:
            return True
        self.rt.drive(lambda s: s.phase is not Phase.NORMAL or (s.epoch, s.step) != attempt)
        self.rt.drive(lambda s: s.phase is Phase.NORMAL)
        return False

    def _group_fault(self, e: BaseException) -> None:
        """A member of a shard group raised inside its step: its group mates may be inside
        an FSDP collective with it, which Gloo cannot abort. It ends; its agent restarts
        the group, which heals from the other groups (a Fault1 of the group)."""
        log.error(
            "rank %d raised in step %d; its group restarts", self.rt.rank, self.rt.step, exc_info=e
        )
        self.rt.events.emit("group_fault", step=self.rt.step, error=repr(e)[:300])
        self.rt.events.close()
        exit_now(EXIT_GROUP_FAULT, f"raised in step {self.rt.step}: {e!r}"[:300])


def hold_stage(rt: RuntimePorts) -> bool:
    """Before an attempt of the runtime's current step: hold this stage at the staleness
    bound (heartbeat shielded, like a collective). False: a fault came first."""
    x, flow = rt.engine, rt.flow
    assert flow is not None
    now = x.seen()
    epoch, step, gen = now.state.epoch, now.state.step, now.phase_changes

    def cancelled() -> bool:
        return x.closing or x.phase_changes != gen

    with rt.heartbeat.blocked:
        held = flow.hold(step, cancelled)
    if held is None:
        rt.drive(lambda s: (s.epoch, s.step) != (epoch, step) or x.phase_changes != gen)
        return False
    if held > POLL_S:
        rt.events.emit("held", epoch=epoch, step=step, held_ms=round(held * 1e3, 3))
    return True
