"""The step's one collective after its gradients (:class:`Agreement`): whether the step is
decided without the store (``--decide collective``), whether every member drew the same
batches (:mod:`fastft.runtime.state.data`), and the in-band replica check with its repair
(:mod:`fastft.runtime.state.compare`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from fastft.bus.nats import is_nats
from fastft.inject import StateLostFault
from fastft.interrupt import allreduce as interruptible_allreduce
from fastft.runtime.checks import by_collective
from fastft.runtime.endings import DataDiverged, ReplicaMismatch, ReplicasDiverged, ScriptError
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
from fastft.runtime.state.inband import SLOTS, InBand, exact

if TYPE_CHECKING:
    from fastft.runtime.ports import RuntimePorts
    from fastft.runtime.transaction import Transaction

__all__ = ["Agreement", "script_error"]

log = logging.getLogger(__name__)


def script_error(
    rt: RuntimePorts, step: int, why: str, cause: BaseException | None = None
) -> NoReturn:
    """End the worker with the script's error (no retry or restart can help)."""
    rt.events.emit("script_error", step=step, error=why)
    log.critical("%s", why)
    raise ScriptError(why) from cause


class Agreement:
    """What the members agree on after a step's gradients (see the module); one per
    worker, kept across attempts (the repairs it made, by step)."""

    def __init__(self, rt: RuntimePorts) -> None:
        self.rt = rt
        self.batches: list[Batches] = []
        """Registered ``fastft.Batches``: their digests are compared before each vote."""
        self.compare = False
        """Whether the in-band replica check is due in this attempt (:meth:`begin`)."""
        self.healed: dict[tuple[str, ...], int] = {}
        """Items of the replicas that differed, by the step their minority healed at."""
        self.retried: tuple[int, tuple[str, ...]] | None = None
        """The step (and items) the last mismatch without a majority ran again."""
        self.compared: tuple[int, int] = (-1, 0)
        """(epoch, step) of this member's first attempt in its current epoch."""
        self.inband = InBand()
        """The vote the attempt's gradients' allreduce carried (:mod:`fastft.runtime.state.inband`)."""
        self.drawn: tuple[int, ...] = ()
        """The batch digests the in-band vote carried (a step that draws more after its
        gradients' allreduce compares them all in the agreement's own allreduce)."""
        self.contact = time.monotonic()
        """When this member last knew every member of its epoch was in it: its last commit,
        or its epoch's first attempt (:meth:`late`)."""

    def begin(self, epoch: int, step: int, world: int) -> bool:
        """This attempt begins: whether the in-band replica check runs in it: every ``--compare-every``
        steps, and in the first two steps of every epoch (a fault's recovery: the first
        sees a heal that missed something, the second state that lives outside the
        registered objects, such as JAX parameters kept in the script's own variables);
        with 2 members or more, not with shard groups (members hold different shards).
        Every member of an epoch began it at the same step: all decide alike."""
        self.inband.begin()
        if self.compared[0] != epoch:
            self.compared = (epoch, step)
            self.contact = time.monotonic()
        every = self.rt.config.compare_every
        self.compare = bool(every and world >= 2 and not self.rt.sharded) and (
            step % every == 0 or step - self.compared[1] < 2
        )
        return self.compare

    def late(self) -> bool:
        """Whether a step decided by its collective now must confirm its commit in the
        store (:class:`~fastft.fsm.GradsReady`): the collective completed so long after
        this member's last :attr:`contact` that its node may have been declared lost
        meanwhile (``node_silence_ms``), and the others left the epoch. A Gloo operation
        they abandoned goes on without them and completes when the cut mends: a node cut
        off for 8 s committed a step the others had rolled back and re-formed without it
        (1 run in 2 of ``tests/net``'s cut with the key-value leader). An abandoned NCCL
        communicator is aborted (nothing completes on it); one node has no lease."""
        silence = self.rt.config.node_silence_ms
        if silence is None or self.rt.engine.dp.backend() == "nccl":
            return False
        return time.monotonic() - self.contact > silence / 1000 * 0.75

    def slots(self) -> int:
        """Slots the gradients' bucket holds for the in-band vote (``fastft.jax``'s pmean
        buffer always holds :data:`SLOTS`: no shard groups there): none with shard groups
        (FSDP reduces inside each group), the same number on every member of an epoch
        (one configuration). With the store's vote too, unused: the bucket's size sets
        how Gloo's ring splits it, so the sums' order (and the model's bits) would
        depend on how the steps are decided."""
        return 0 if self.rt.sharded else SLOTS

    def carry(self, slots: torch.Tensor | None) -> bool:
        """Before the gradients' allreduce: this member's vote into ``slots`` (the flags it
        would raise in :meth:`run`'s allreduce, its batch digest). False: nothing to carry
        (no slots, one member, a bucket type that would not sum them exactly, or
        ``--decide store``)."""
        world = self.rt.world
        if slots is None or world < 2 or not exact(slots.dtype, world):
            return False
        if self.rt.config.decide == "store":
            return False
        now = self.rt.engine.seen().state
        self.drawn = self._drawn()
        self.inband.fill(slots, now.want_drain, now.joining, self._digest())
        return True

    def carried(self, slots: torch.Tensor) -> None:
        """After the gradients' allreduce completed: what every member's vote said."""
        self.inband.read(slots, self.rt.world)

    def _drawn(self) -> tuple[int, ...]:
        return tuple(-1 if b.digest is None else b.digest for b in self.batches)

    def _digest(self) -> int:
        return batch_digest(self._drawn()) if self.batches else 0

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

    def run(self, tx: Transaction) -> bool:
        """The step's one collective after its gradients: an allreduce (max) of
        ``(batch digest, -batch digest, drains, joins)`` over the epoch, equal on every
        member that completes it. Whether the step is decided (``--decide collective``:
        every member reached it, none drains or saw a joiner, so the step commits without
        the store; docs/architecture.md "The fault-free decision"); and whether every
        member drew the same batches: no loader quirk may train silently on the wrong data
        (:mod:`fastft.runtime.state.data`; a difference raises DataDiverged)."""
        rt = self.rt
        x = rt.engine
        inband = self.inband.take()
        collective = inband is not None or by_collective(
            rt.config.decide, tx.world, x.dp.backend(), is_nats(rt.config.store)
        )
        late = bool(self.batches) and self._drawn() != self.drawn  # (after the gradients)
        if inband is not None and inband.same_batches and not self.compare and not late:
            return not inband.flagged  # (decided by the gradients' allreduce: no second)
        t0 = time.perf_counter()
        try:
            compare = self._replica_sums(tx.step) if self.compare else None
        except TypeError as e:  # (a registered state_dict() that changed its kind)
            script_error(self.rt, tx.step, f"the replica check: {e}", e)
        t1 = time.perf_counter()
        if not (collective or (self.batches and tx.world > 1) or compare is not None):
            return False
        now = x.seen().state
        flags = [int(now.want_drain), int(now.joining)]
        if tx.world == 1:
            return collective and not any(flags)
        mine = self._digest()
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
