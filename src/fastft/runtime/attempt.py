"""One attempt of one step, as the runtime runs it: entering (the staleness bound's hold,
DiLoCo's outer step, the shard group's gate, the snapshot) and leaving (the vote, or what
an exception means). :class:`StepAttempts` owns the attempt's own state (retries in a row,
the phase changes an attempt began at, the registered batches to compare) and uses the
runtime through its ports (:class:`~fastft.runtime.ports.RuntimePorts`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fastft.bus.nats import is_nats
from fastft.fsm import GradsReady, Phase
from fastft.inject import StateLostFault
from fastft.interrupt import CollectiveFailed, StepInterrupted
from fastft.interrupt import allreduce as interruptible_allreduce
from fastft.process.teardown import exit_now
from fastft.protocol.exits import EXIT_GROUP_FAULT
from fastft.runtime.checks import by_collective
from fastft.runtime.endings import (
    DataDiverged,
    ReplicaMismatch,
    ReplicasDiverged,
    ScriptError,
    misuse,
    repeated,
    signature,
)
from fastft.runtime.groups.flow import POLL_S
from fastft.runtime.state.compare import (
    checksums,
    differs,
    repair,
    replica_items,
    row,
    vector,
    verdict,
)
from fastft.runtime.state.data import Batches, batch_digest
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
        self.batches: list[Batches] = []
        """Registered ``fastft.Batches``: their digests are compared before each vote."""
        self.retries = 0
        self.raised: tuple[int, tuple[str, str, str]] | None = None
        """The step and the error its last attempt raised, if the script's kind of error
        (:func:`~fastft.runtime.endings.signature`): the same again in its retry stops it."""
        """Attempts of the current step that raised, in a row."""
        self.step_gen = 0
        """The engine's phase changes when the current attempt began."""
        self.gate_gen = 0
        """... when it crossed the shard group's gate."""
        self.compare = False
        """Whether the in-band replica check is due in this attempt
        (:mod:`fastft.runtime.state.compare`; :meth:`_agree` runs it)."""
        self.healed: dict[tuple[str, ...], int] = {}
        """Items of the replicas that differed, by the step their minority healed at."""
        self.retried: tuple[int, tuple[str, ...]] | None = None
        """The step (and items) the last mismatch without a majority ran again."""
        self.compared: tuple[int, int] = (-1, 0)
        """(epoch, step) of this member's first attempt in its current epoch."""
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
        while not self._begin_attempt():
            pass
        s, view = x.state, x.view
        assert view is not None
        tx.step, tx.epoch = s.step, s.epoch
        tx.rank, tx.world = view.index(self.rt.rank), len(view.members)
        x.kept.begin_attempt()
        if self.rt.config.reseed:  # (fastft.init(reseed=False): the script seeds its own)
            reseed(self.rt.config.seed, s.step, tx.rank)
        self.rt.registry.begin_step()
        self.compare = self._compare_due(s.epoch, s.step, tx.world)
        verified = self.rt.registry.verified  # (what a mismatch's repair goes back to)
        if self.compare and (s.step % self.rt.config.compare_every == 0 or verified.step is None):
            # the periodic checks only, once there is a copy: an epoch's first two steps
            # follow every recovery, and a copy there would lengthen each one (seconds of
            # a large model's state)
            verified.hold(self.rt.registry, s.step)
        for batches in self.batches:
            batches.start_step()
        self.rt.heartbeat.beat()
        self.rt.interrupter.begin_step(s.epoch, s.step)
        self.step_gen = x.phase_changes
        if self.rt.sharded:  # FSDP's collectives inside the group finish; the reduce is interrupted
            self.rt.interrupter.defer(self.rt.config.rollback_timeout_s / 2)
            if self.gate_gen != self.step_gen:  # a fault came after the gate: the mates run
                self.step_gen = self.gate_gen  # the body (FSDP pairs them); it then rolls back
                self.rt.interrupter.interrupt(
                    "a fault as the step began", epoch=s.epoch, step=s.step
                )
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
                agreed = self._agree(tx)  # (raises DataDiverged: the job ends)
            except (StepInterrupted, Exception) as e:  # as if the step's body had raised it
                et, ev = type(e), e
        self.rt.interrupter.end_step()
        self.rt.heartbeat.beat()
        step = tx.step
        if et is None:
            with x.lock:
                if x.state.phase is Phase.NORMAL and x.state.step == step:
                    x.feed_locked(GradsReady(agreed=agreed))
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

    def _script_error(self, step: int, why: str, cause: BaseException | None = None) -> None:
        self.rt.events.emit("script_error", step=step, error=why)
        log.critical("%s", why)
        raise ScriptError(why) from cause

    def _compare_due(self, epoch: int, step: int, world: int) -> bool:
        """Whether the in-band replica check runs in this attempt: every ``--compare-every``
        steps, and in the first two steps of every epoch (a fault's recovery: the first
        sees a heal that missed something, the second state that lives outside the
        registered objects, such as JAX parameters kept in the script's own variables);
        with 2 members or more, not with shard groups (members hold different shards).
        Every member of an epoch began it at the same step: all decide alike."""
        if self.compared[0] != epoch:
            self.compared = (epoch, step)
        every = self.rt.config.compare_every
        if not every or world < 2 or self.rt.sharded:
            return False
        return step % every == 0 or step - self.compared[1] < 2

    def _replica_sums(self, step: int) -> list[tuple[str, int]]:
        """The checksums, by item, of the state this attempt began with."""
        cfg = self.rt.config
        # the parameters are common state after a sync (every step per-step; with
        # every-k:N after each N-th; never with DiLoCo, whose anchor is)
        kind = cfg.sync_kind
        replicated = kind == "per-step" or (kind == "every-k" and step % cfg.sync_every == 0)
        turn = step // max(cfg.compare_every, 1)  # (the next chunks of large tensors)
        items = replica_items(
            self.rt.registry, replicated=replicated, local_steps=kind != "per-step"
        )
        return checksums(items, turn)

    def _agree(self, tx: Transaction) -> bool:
        """The step's one collective after its gradients: an allreduce (max) of
        ``(batch digest, -batch digest, drains, joins)`` over the epoch, equal on every
        member that completes it. Whether the step is decided (``--decide collective``:
        every member reached it, none drains or saw a joiner, so the step commits without
        the store; docs/architecture.md "The fault-free decision"); and whether every
        member drew the same batches: no loader quirk may train silently on the wrong data
        (:mod:`fastft.runtime.state.data`; a difference raises DataDiverged)."""
        rt = self.rt
        x = rt.engine
        collective = by_collective(
            rt.config.decide, tx.world, x.dp.backend(), is_nats(rt.config.store)
        )
        t0 = time.perf_counter()
        try:
            compare = self._replica_sums(tx.step) if self.compare else None
        except TypeError as e:  # (a registered state_dict() that changed its kind)
            self._script_error(tx.step, f"the replica check: {e}", e)
        t1 = time.perf_counter()
        if not (collective or (self.batches and tx.world > 1) or compare is not None):
            return False
        with x.lock:
            flags = [int(x.state.want_drain), int(x.state.joining)]
        if tx.world == 1:
            return collective and not any(flags)
        digests = tuple(-1 if b.digest is None else b.digest for b in self.batches)
        mine = batch_digest(digests) if self.batches else 0
        sums = vector(compare) if compare is not None else []
        both = torch.tensor(
            [mine, -mine, *flags, *sums], dtype=torch.int64, device=x.dp.comm_device()
        )
        with rt.heartbeat.blocked:
            interruptible_allreduce(
                rt.require_pg(),
                [both],
                rt.interrupter,
                op=dist.ReduceOp.MAX,  # type: ignore[arg-type]
            )
        if self.batches:
            self._compare_batches(tx, mine, int(both[0]), -int(both[1]))
        if compare is not None:
            if differs(both[4:].tolist()) and not self._replicas_diverged(tx, compare):
                return False  # (the minority's fault rolls the step back)
            rt.registry.verified.passed(tx.step)
            rt.events.emit(  # (what each check costs: sums, then with the allreduce)
                "replica_check",
                step=tx.step,
                sums_ms=round((t1 - t0) * 1e3, 3),
                ms=round((time.perf_counter() - t0) * 1e3, 3),
            )
        return collective and not any(both[2:4].tolist())

    def _replicas_diverged(self, tx: Transaction, compare: list[tuple[str, int]]) -> bool:
        """Some member holds other state: every member gathers every member's checksums
        (a second allreduce, on this path only), names what differs and where, and
        repairs it (:func:`~fastft.runtime.state.compare.repair`): a member of the
        minority raises its state's loss (it heals from the majority), the others roll
        the step back with it; or every member retries the step, or declares its state
        lost for the durable tier, or the job ends. False: this member goes on to vote
        (not decided by the collective: the minority's fault rolls the step back)."""
        rt, x = self.rt, self.rt.engine
        view = x.view
        assert view is not None
        held = rt.registry.verified.step  # (the step of its last verified state, if any)
        mine = [*row(compare), -1 if held is None else held]
        rows = torch.zeros(tx.world, len(mine), dtype=torch.int64, device=x.dp.comm_device())
        rows[tx.rank] = torch.tensor(mine, dtype=torch.int64)
        with rt.heartbeat.blocked:
            interruptible_allreduce(rt.require_pg(), [rows], rt.interrupter)
        got = {m.rank: r[:-1] for m, r in zip(view.members, rows.tolist(), strict=True)}
        v = verdict(tx.step, tx.epoch, [n for n, _ in compare], got)
        back = {int(b) for b in rows[:, -1].tolist()}  # (every member holds the same one)
        verified = back.pop() if len(back) == 1 and 0 <= min(back) < tx.step else None
        do = repair(
            v,
            step=tx.step,
            healed=self.healed,
            retried=self.retried,
            durable=bool(rt.config.checkpoint_dir),
            fresh=tx.step - self.compared[1] < 2 and bool(view.needs_state),
            verified=verified,
        )
        rt.events.emit(
            "replicas_diverged",
            epoch=tx.epoch,
            step=tx.step,
            items=list(v.items),
            minority=list(v.minority),
            action=do.action,
            error=v.message,
            repair=do.why,
            **({"to": verified} if do.action == "rewind" else {}),
        )
        if do.action == "stop":
            log.critical("%s", do.why)
            raise ReplicasDiverged(do.why)
        log.error("%s", do.why)
        if do.action == "rewind":  # every member goes back to the verified state
            assert verified is not None
            self.healed[v.items] = tx.step
            rt.registry.verified.want(verified)
            raise StateLostFault(do.why)
        if do.action == "heal":
            self.healed[v.items] = tx.step
            if self.rt.rank in v.minority:
                raise StateLostFault(do.why)
            return False
        if do.action == "retry":
            self.retried = (tx.step, v.items)
            raise ReplicaMismatch(do.why)
        raise StateLostFault(do.why)  # restore: every member's state is suspect

    def _compare_batches(self, tx: Transaction, mine: int, top: int, low: int) -> None:
        if top == low:
            return
        why = (
            f"the members of epoch {tx.epoch} drew different batches in step {tx.step} "
            f"(batch digests from {low:#x} to {top:#x}; this member's {mine:#x}): the "
            "data loader's order or its samples' content is not a function of its state on "
            "every member (a loader restored differently, a shuffle seeded per process, "
            "random augmentation that fastft.Batches cannot seed: an iterable dataset, "
            "seed_samples=False, RNGs of the dataset's own); the step is not committed and "
            "the job stops rather than train on the wrong data"
        )
        self.rt.events.emit("data_diverged", epoch=tx.epoch, step=tx.step, error=why)
        log.critical("%s", why)
        raise DataDiverged(why)

    def _begin_attempt(self) -> bool:
        """Wait for a step to attempt; run DiLoCo's outer step when it begins one, then
        cross the shard group's gate. False: a fault came first; wait for the next."""
        x = self.rt.engine
        self.rt.drive(lambda s: s.phase is Phase.NORMAL)
        if self.rt.flow is not None and not hold_stage(self.rt):
            return False  # (the staleness bound held it; a fault came first)
        ok = True
        if outer_due(self.rt, x.state.step):
            with x.lock:
                epoch, step, self.step_gen = x.state.epoch, x.state.step, x.phase_changes
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
        with x.lock:
            attempt = (x.state.epoch, x.state.step)
            go = ok and x.state.phase is Phase.NORMAL
            self.gate_gen = x.phase_changes
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
    with x.lock:
        epoch, step, gen = x.state.epoch, x.state.step, x.phase_changes

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
