"""The worker runtime: the transactional step, epochs and healing on one worker.

One :class:`Runtime` per process. Its brain is the pure state machine
(:func:`fastft.fsm.decide`); this module is its executor. Events come from two threads:
the bus listener (peers' faults, rollback requests and acks, joins) and the main thread
(the step finished, a local exception, a decision read from the store). Both feed
:meth:`Runtime._feed`, which runs ``decide`` under one lock and performs the *immediate*
actions on the spot (interrupt the step, propose ROLLBACK in the store, broadcast on the
bus) and queues the rest (vote, apply the commit, drop gradients, form the next epoch,
build its process group, send or fetch state) for the main thread, which runs them in
:meth:`Runtime._drive`.

The main thread is interrupted (``fastft.interrupt``) only inside the user's step body;
the runtime's own machinery is shielded from the signal and checks the state machine at
its own safe points instead.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import datetime
import faulthandler
import logging
import mmap
import os
import queue
import secrets
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastft.bus import BusConfig, connect_store, tcpstore_bus
from fastft.fsm import (
    AbortProcessGroup,
    Action,
    ApplyCommit,
    BroadcastDrainNotice,
    BroadcastRollbackAck,
    BroadcastRollbackRequest,
    CancelFutures,
    CastVote,
    CommitApplied,
    ConfigureProcessGroup,
    Deadline,
    Decision,
    DeclareDead,
    DrainAcked,
    DrainNoticed,
    Event,
    ExitWorker,
    FetchState,
    FormEpoch,
    GradsReady,
    HealDone,
    InterruptStep,
    InvalidTransition,
    JoinRequested,
    LocalFault,
    PeerFault,
    Phase,
    ProposeRollback,
    QuorumReady,
    RollbackAcked,
    RollbackRequested,
    SendDrainAck,
    SendState,
    Shutdown,
    StateLoaded,
    StepState,
    ZeroGrads,
    decide,
    initial_state,
)
from fastft.inject import FaultKind, FaultPlan, FaultSpec, Injector, StateLost, execute
from fastft.interrupt import Interrupter, StepInterrupted, start_broadcast, wait_work
from fastft.interrupt import allreduce as interruptible_allreduce
from fastft.interrupt import broadcast as interruptible_broadcast
from fastft.interrupt import broadcast_bytes as interruptible_broadcast_bytes
from fastft.protocol import (
    DrainAck,
    DrainNotice,
    Fault,
    HangSuspected,
    Inject,
    JobKeys,
    JoinRequest,
    Message,
    ProcessExited,
    RollbackAck,
    RollbackRequest,
    Severity,
)
from fastft.runtime import malloc
from fastft.runtime.contract import (
    SPARE_RUN_AHEAD,
    STACKS_SIGNAL,
    EpochView,
    JobFinished,
    Member,
    RuntimeConfig,
    WorkerExit,
    choose_backend,
)
from fastft.runtime.coordinator import ADMIT, COMMIT, Coordinator
from fastft.runtime.events import EventLog
from fastft.runtime.sentinel import start_exit_sentinel
from fastft.runtime.shards import plan as plan_shards
from fastft.runtime.shards import tile
from fastft.runtime.state import StateRegistry, reseed

__all__ = ["Runtime", "Transaction", "init"]

log = logging.getLogger(__name__)

_MAIN_ACTIONS = (
    CastVote,
    ApplyCommit,
    ZeroGrads,
    ConfigureProcessGroup,
    FormEpoch,
    FetchState,
    SendState,
    ExitWorker,
)
_WAIT_S = 0.05
_DECISION_WAIT_S = 0.5
_HEALING_ACTIONS = (FormEpoch, ConfigureProcessGroup, FetchState, SendState)
_STEP_CYCLE = (Phase.NORMAL, Phase.PREPARED, Phase.COMMIT)


class Transaction:
    """One attempt of one step; use as a context manager from :meth:`Runtime.transaction`.

    ``step``: the step number; ``rank``/``world``: this worker's dense rank and the
    number of members in the current epoch (partition the step's global batch by them);
    ``committed`` is set when the ``with`` block ends.
    """

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self.step = -1
        self.epoch = -1
        self.rank = -1
        self.world = 0
        self.committed = False

    def __enter__(self) -> Transaction:
        return self._rt._enter(self)

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        return self._rt._exit(self, et, ev)

    def shard(self, n: int) -> slice:
        """This member's part of the step's global batch of ``n`` samples: contiguous and
        balanced (the first ``n % world`` members take one more), so whatever the epoch's
        size every sample of a committed step is consumed exactly once (S5 when the world
        shrinks). After it, :meth:`allreduce_gradients` weights each member's gradient by
        its share: the result is the gradient of the mean over the whole global batch.

        In an elastic world, the attempts of a step after it rolled back give each member
        a piece of the samples nobody kept: the members that had finished their part add
        the gradient they kept (``keep_gradients``, :mod:`fastft.runtime.shards`)."""
        rt = self._rt
        view = rt._view
        mine: tuple[int, int] | None = None
        if view is not None and view.kept and view.step == self.step:
            ranks = view.ranks
            offered = {view.index(r): (lo, hi, m) for r, lo, hi, m in view.kept if r in ranks}
            p = plan_shards(n, self.world, offered)
            lo, hi = p.pieces[self.rank]
            mine = p.kept.get(self.rank)
            if mine is not None and rt._kept != (self.step, *mine, n):  # pragma: no cover
                raise AssertionError(f"kept gradient {rt._kept} is not the offered {mine}")
        elif n < self.world:
            raise ValueError(f"a global batch of {n} samples cannot feed {self.world} members")
        else:
            lo, hi = tile(0, n, self.world, self.rank)
        rt._share = (lo, hi, n)
        rt._adding_kept = mine
        # A part that will be kept is worth finishing: a peer's fault from here on is
        # raised when the part is done (at the allreduce), not in the middle of it, and
        # the retry adds the part instead of computing a larger one from scratch; for at
        # most half the rollback timeout, which is how long the closer of the next epoch
        # waits for a survivor before it leaves it out.
        rt.interrupter.defer_s = rt.config.rollback_timeout_s / 2 if rt._keep and not mine else 0.0
        return slice(lo, hi)

    def allreduce_gradients(self, model: nn.Module | None = None) -> None:
        """Average the gradients of the registered model over the epoch (interruptible);
        weighted by the members' shares when :meth:`shard` was used."""
        self._rt.injector.fire_due(self.step, point="collective")
        self._rt._allreduce_gradients(model)

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` in place over the epoch's members (interruptible)."""
        rt = self._rt
        with rt._waiting():
            interruptible_allreduce(rt._require_pg(), tensors, rt.interrupter)


class Runtime:
    """fastft on one worker. Build it with :func:`init`."""

    def __init__(self, config: RuntimeConfig, *, store: dist.Store | None = None) -> None:
        malloc.tune()  # steps that do not depend on what the process freed before
        self.config = config
        self.rank = config.rank
        self.incarnation = config.incarnation or (secrets.randbits(62) | 1)
        self.me = Member(self.rank, self.incarnation)
        self.keys = JobKeys(config.job)
        self.events = EventLog(config.run_dir, f"rank {self.rank}")
        self.registry = StateRegistry()
        self._store = store if store is not None else connect_store(config.store)
        self._side_store = self._store.clone()  # type: ignore[attr-defined]
        self._side_lock = threading.Lock()
        decisions = self._store.clone()  # type: ignore[attr-defined]
        decisions.set_timeout(datetime.timedelta(seconds=_DECISION_WAIT_S))
        self.coord = Coordinator(
            self._store,
            self.keys,
            self.rank,
            self.incarnation,
            config.world_size,
            config.min_members,
            decision_store=decisions,
        )
        self._garbage: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._collector = threading.Thread(
            target=self._collect, name="fastft-store-gc", daemon=True
        )
        self._collector.start()
        if threading.current_thread() is threading.main_thread():
            # The agent sends it before it kills a worker it found hung: every thread's
            # Python stack goes to stderr (works while a thread holds the GIL).
            faulthandler.register(STACKS_SIGNAL, all_threads=True)
        self.interrupter = Interrupter().install()
        self.interrupter.end_step()
        self.interrupter.shield(
            Runtime._enter,
            Runtime._exit,
            Runtime._drive,
            Runtime._run_main_action,
            Runtime.close,
        )
        plan = FaultPlan.load(config.inject) if config.inject else FaultPlan(faults=())
        self.injector = Injector(plan, self.rank, config.life, executor=self._inject)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._fsm: StepState = initial_state(self.rank)
        self._phase_since = time.monotonic()
        self._phase_changes = 0
        self._action_gen = 0
        self._step_gen = 0
        self._todo: collections.deque[tuple[int, Action]] = collections.deque()
        """Main-thread actions, each with the count of phase changes when it was queued."""
        self._view: EpochView | None = None
        self._pg: Any = None
        self._pg_epoch = -1
        self._abandoned: list[Any] = []  # never destroyed mid-operation, never reused
        self._heal_pg: tuple[int, Any] | None = None
        """(epoch, group) of the source and the members it heals (:meth:`_heal_ranks`)."""
        self._heal_tail: _HealTail | None = None
        """The optimizer state of this epoch's heal, still in transit while the step runs
        (sent or received over the heal group): finished before the vote."""
        self._dead: set[Member] = set()
        self._closing = False
        self._retries = 0
        self._registered = False
        self._share: tuple[int, int, int] | None = None
        """(lo, hi, n): the slice of the global batch this member took in this step."""
        self._keep = config.keep_gradients and config.elastic
        self._kept: tuple[int, int, int, int] | None = None
        """(step, lo, hi, n) of the weighted local gradient in ``_kept_grad``."""
        self._kept_grad: torch.Tensor | None = None
        self._kept_now = False
        """``_kept`` was taken by this attempt."""
        self._adding_kept: tuple[int, int] | None = None
        """The kept range this attempt adds to its own part (``Transaction.shard``)."""
        self._faulted = False
        """This attempt raised a local fault: what it computes is not kept."""
        self._backend_chosen: str | None = None
        self.commits = 0
        self.rollbacks = 0
        self._decision_wait_ms: float | None = None
        self._hb = Heartbeat(config.heartbeat_file)
        start_exit_sentinel(config.exit_trace_file)
        self.bus = tcpstore_bus(
            self._store,
            BusConfig(job=config.job, rank=self.rank, incarnation=self.incarnation),
        )
        self.bus.subscribe(self._on_message)
        self.bus.start()
        self.events.emit(
            "worker_start",
            incarnation=self.incarnation,
            life=config.life,
            pid=os.getpid(),
            ran_ahead=_ran_ahead(),
        )

    # --- public API ------------------------------------------------------------------------
    def register(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **others: Any,
    ) -> Runtime:
        """Register what a step changes and a heal transfers, then join the job: returns
        once this worker is a member of an epoch and holds the committed state."""
        self.registry.register(model, optimizer, **others)
        if model is not None:
            self._backend()  # a backend that cannot work with this model fails here
        self._registered = True
        self._drive(lambda s: s.phase is Phase.NORMAL)
        return self

    @property
    def step(self) -> int:
        """Number of committed steps (the step the next transaction runs)."""
        return self._fsm.step

    @property
    def epoch(self) -> int:
        return self._fsm.epoch

    @property
    def world(self) -> int:
        return len(self._view.members) if self._view else 0

    def transaction(self) -> Transaction:
        """``with ft.transaction() as tx:`` one step: commits on every member or on none."""
        return Transaction(self)

    def no_hang_check(self) -> _Blocked:
        """A context manager for long work between steps (evaluation, a checkpoint): the
        heartbeat goes on while it runs, so the agent's hang timeout (adaptive or not)
        does not kill the worker. A real hang inside it is not detected."""
        return self._hb.blocked

    def digest(self) -> str:
        """Hash of the replicated state at the current step (S3)."""
        return self.registry.digest(self.step)

    def close(self) -> None:
        """Leave the job. Idempotent."""
        if self._closing:
            return
        self._closing = True
        view = self._view
        if (
            self._fsm.phase is Phase.NORMAL
            and view is not None
            and view.has(self.rank, self.incarnation)
        ):
            try:  # a member ends after a committed step: joiners need not wait any more
                self._store.set(self.keys.finished, str(self._fsm.step))
            except Exception:  # noqa: BLE001 - the store may be gone at the very end
                log.debug("could not mark the job finished", exc_info=True)
        with self._lock:
            self._feed_locked(Shutdown("closed"))
            self._cond.notify_all()
        self.events.emit(
            "worker_stop", step=self._fsm.step, commits=self.commits, rollbacks=self.rollbacks
        )
        self._garbage.put(None)
        self._collector.join(timeout=1)
        self.bus.close()
        self.interrupter.close()
        self._hb.close()
        self.events.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the step --------------------------------------------------------------------------
    def _enter(self, tx: Transaction) -> Transaction:
        if not self._registered:
            raise RuntimeError("call ft.register(model=..., optimizer=...) before a transaction")
        self._drive(lambda s: s.phase is Phase.NORMAL)
        s = self._fsm
        view = self._view
        assert view is not None
        tx.step, tx.epoch = s.step, s.epoch
        tx.rank, tx.world = view.index(self.rank), len(view.members)
        self._share = None
        self._adding_kept = None
        self._faulted = False
        self._kept_now = False
        reseed(self.config.seed, s.step, tx.rank)
        self.registry.begin_step()
        self._hb.beat()
        self.interrupter.begin_step(s.epoch, s.step)
        self._step_gen = self._phase_changes
        try:
            self.injector.fire_due(s.step)
        except Exception as e:  # an injected exception: a local fault of this step
            self._local_fault(e)
        return tx

    def _exit(self, tx: Transaction, et: Any, ev: Any) -> bool:
        if et is None and self._heal_tail is not None:
            try:
                self._finish_heal_tail()
            except (StepInterrupted, Exception) as e:  # as if the step's body had raised it
                et, ev = type(e), e
        self.interrupter.end_step()
        self._hb.beat()
        step = tx.step
        if et is None:
            with self._lock:
                if self._fsm.phase is Phase.NORMAL and self._fsm.step == step:
                    self._feed_locked(GradsReady())
            self._drive(
                lambda s: (
                    s.step != step
                    or s.phase not in (Phase.PREPARED, Phase.COMMIT, Phase.DRAIN_COMMIT)
                )
            )
            tx.committed = self._fsm.step > step
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
        if isinstance(ev, Exception):
            self._retries += 1
            self._local_fault(ev, gen=self._step_gen)
            if self._retries > self.config.max_step_retries:
                log.error("step %d failed %d times in a row: giving up", step, self._retries)
                return False
            return True
        return False  # KeyboardInterrupt, SystemExit, ...

    def _local_fault(self, exc: BaseException, gen: int | None = None) -> None:
        """Report this worker's own fault: event, bus, state machine. ``gen``: the count of
        phase changes when the failed work began; if the state machine moved since (a
        peer's fault already rolled the step back, and perhaps finished the rollback), the
        failure is a consequence of that fault and starts nothing: a second rollback
        cycle there would wait for members that are already past it."""
        severity = Severity.FAULT1 if isinstance(exc, StateLost) else Severity.FAULT2
        cause = f"{type(exc).__name__}: {exc}"
        # nothing this attempt computed is offered as kept (an exception may mean a bad
        # gradient); a part kept by an earlier attempt of the step stays valid
        self._faulted = True
        if self._kept_now:
            self._kept, self._kept_now = None, False
        with self._lock:
            if gen is not None and gen != self._phase_changes and severity is Severity.FAULT2:
                self.events.emit("local_fault_superseded", step=self._fsm.step, cause=cause[:300])
                return
            self.events.emit(
                "local_fault",
                step=self._fsm.step,
                epoch=self._fsm.epoch,
                severity=severity.name,
                cause=cause[:500],
                incarnation=self.incarnation,
            )
            self.bus.broadcast(
                Fault(
                    job=self.config.job,
                    epoch=self._fsm.epoch,
                    rank=self.rank,
                    incarnation=self.incarnation,
                    step=self._fsm.step,
                    severity=severity,
                    cause=cause[:2000],
                    faulty_rank=self.rank,
                    faulty_incarnation=self.incarnation,
                )
            )
            self._feed_locked(LocalFault(severity, cause[:200]))

    def _allreduce_gradients(self, model: nn.Module | None) -> None:
        if model is not None and self.registry.model is None:
            self.registry.register(model=model)
        flat = self.registry.grad_bucket()
        grads: list[torch.Tensor] = []
        if flat is None:  # mixed dtypes or devices: flatten a copy
            grads = self.registry.gradients()
            flat = torch._utils._flatten_dense_tensors(grads)
        share = self._share
        if share is not None:
            lo, hi, n = share
            flat.mul_((hi - lo) / n)
            if self._adding_kept is not None:
                assert self._kept_grad is not None
                flat.add_(self._kept_grad)
            elif self._keep and not self._faulted:
                # a copy the allreduce cannot touch: if the world shrinks in this step,
                # the retry computes only the lost members' samples and adds it. Taken
                # before the interrupt check: a peer's fault during this member's own
                # part was deferred to here (Transaction.shard), the part is done.
                kg = self._kept_grad
                if kg is None or (kg.shape, kg.dtype, kg.device) != (
                    flat.shape,
                    flat.dtype,
                    flat.device,
                ):
                    self._kept_grad = kg = torch.empty_like(flat)
                kg.copy_(flat)
                self._kept, self._kept_now = (self._fsm.step, lo, hi, n), True
        pg = self._require_pg()
        with self._waiting():
            interruptible_allreduce(pg, [flat], self.interrupter)
        if share is None:
            flat.div_(self.world)
        if grads:
            unflat = torch._utils._unflatten_dense_tensors(flat, grads)
            for g, r in zip(grads, unflat, strict=True):
                g.copy_(r)

    def _require_pg(self) -> Any:
        self.interrupter.check()
        if self._pg is None:
            raise RuntimeError("no process group: collectives run inside ft.transaction()")
        return self._pg

    # --- the executor ----------------------------------------------------------------------
    def _feed_locked(self, event: Event) -> None:
        before = self._fsm
        try:
            new, actions = decide(before, event)
        except InvalidTransition as e:
            log.error("state machine: %s (ignored)", e)
            return
        self._fsm = new
        if new.phase is not before.phase:
            self._phase_since = time.monotonic()
            self._phase_changes += 1
        if new.phase is not before.phase and not (
            before.phase in _STEP_CYCLE and new.phase in _STEP_CYCLE
        ):  # the fault-free cycle NORMAL -> PREPARED -> COMMIT is logged as commits
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
            if isinstance(a, _MAIN_ACTIONS):
                self._todo.append((self._phase_changes, a))
            else:
                self._run_immediate(a)
        self._cond.notify_all()

    def _feed(self, event: Event) -> None:
        with self._lock:
            self._feed_locked(event)

    def _run_immediate(self, a: Action) -> None:
        s = self._fsm
        hdr: dict[str, Any] = dict(
            job=self.config.job,
            epoch=s.epoch,
            rank=self.rank,
            incarnation=self.incarnation,
            step=s.step,
        )
        if isinstance(a, InterruptStep):
            if self.interrupter.interrupt(a.reason, epoch=s.epoch):
                self.events.emit("interrupt", epoch=s.epoch, step=s.step, reason=a.reason)
        elif isinstance(a, ProposeRollback):
            with self._side_lock:
                got = Coordinator.propose_rollback(
                    self._side_store, self.keys, a.epoch, a.step, a.reason
                )
            self.events.emit(
                "propose_rollback", epoch=a.epoch, step=a.step, reason=a.reason, decision=got[:1]
            )
        elif isinstance(a, BroadcastRollbackRequest):
            self.bus.broadcast(RollbackRequest(**hdr, reason=a.reason[:2000]))
        elif isinstance(a, BroadcastRollbackAck):
            self.bus.broadcast(RollbackAck(**hdr))
        elif isinstance(a, AbortProcessGroup):
            self._release_heal_pg(pending=True)
            if self._pg is not None:
                self._abandoned.append(self._pg)
                exit_without_destructors_later()
                if hasattr(self._pg, "abort") and self._backend() == "nccl":
                    self._abort_nccl(self._pg, s.epoch)
                self._pg = None
        elif isinstance(a, CancelFutures):
            pass  # the interrupt already failed every pending future of the step
        elif isinstance(a, BroadcastDrainNotice):
            self.bus.broadcast(DrainNotice(**hdr, reason=a.reason[:2000]))
        elif isinstance(a, SendDrainAck):
            self.bus.broadcast(DrainAck(**hdr, drained_rank=a.rank))
        elif isinstance(a, DeclareDead):
            view = self._view
            for r in sorted(a.ranks):
                inc = view.incarnation(r) if view and r in view.ranks else 0
                self.events.emit("declare_dead", rank=r, incarnation=inc, epoch=s.epoch)
                if inc:  # its exit notice, when the agent has killed it, is no new fault
                    self._dead.add(Member(r, inc))
                    self.coord.dead.add(Member(r, inc))
                self.bus.broadcast(
                    Fault(
                        **hdr,
                        severity=Severity.FAULT1,
                        cause="silent during rollback",
                        faulty_rank=r,
                        faulty_incarnation=inc,
                    )
                )
        else:  # pragma: no cover - a new action without an executor
            raise AssertionError(f"no executor for {a}")

    def _abort_nccl(self, pg: Any, epoch: int) -> None:  # pragma: no cover - NCCL only
        """Abort an abandoned NCCL communicator, off the state machine's lock: the abort
        releases a collective stuck on a dead peer, but it also waits for the kernels
        queued before that collective on the GPU, which can take long. The next epoch
        builds a new communicator meanwhile."""

        def run() -> None:
            t0 = time.monotonic()
            try:
                pg.abort()
            except Exception:
                log.exception("process group abort failed")
            self.events.emit(
                "pg_abort", epoch=epoch, abort_ms=round((time.monotonic() - t0) * 1e3, 3)
            )

        threading.Thread(target=run, name=f"fastft-nccl-abort-{epoch}", daemon=True).start()

    def _drive(self, done: Callable[[StepState], bool]) -> None:
        """Main thread: run queued actions until ``done(state)``."""
        while True:
            with self._lock:
                queued, action = self._todo.popleft() if self._todo else (0, None)
                if isinstance(action, _HEALING_ACTIONS) and queued != self._phase_changes:
                    # queued by a healing that a later fault ended: the new one queued its own
                    log.debug("dropping stale %s", action)
                    continue
                if action is None:
                    s = self._fsm
                    if done(s):
                        return
                    if s.phase is Phase.EXIT:
                        raise WorkerExit(s.reason or "worker left the job")
                    if (
                        s.phase in (Phase.ROLLBACK_REQ, Phase.ROLLBACK_SYNC)
                        and time.monotonic() - self._phase_since > self.config.rollback_timeout_s
                    ):
                        self._phase_since = time.monotonic()
                        self._feed_locked(Deadline(time.monotonic()))
                        continue
                    if s.phase is Phase.INIT:
                        action = _JOIN
                    else:
                        self._hb.beat()
                        self._cond.wait(_WAIT_S)
                        continue
                self._action_gen = queued if action is not _JOIN else self._phase_changes
            self._hb.beat()
            self._run_main_action(action)

    def _run_main_action(self, a: Action) -> None:
        if a is _JOIN:
            self._join()
        elif isinstance(a, CastVote):
            self._vote(a)
        elif isinstance(a, ApplyCommit):
            self._apply_commit(a)
        elif isinstance(a, ZeroGrads):
            self.registry.rollback()
            self.rollbacks += 1
            self.events.emit(
                "rollback", epoch=self._fsm.epoch, step=self._fsm.step, reason=self._fsm.reason
            )
        elif isinstance(a, FormEpoch):
            self._form(a)
        elif isinstance(a, ConfigureProcessGroup):
            self._configure_pg(a)
        elif isinstance(a, FetchState | SendState):
            self._heal(a)
        elif isinstance(a, ExitWorker):
            self.events.emit("exit", reason=a.reason)
            if not self._closing:
                raise WorkerExit(a.reason)
        else:  # pragma: no cover
            raise AssertionError(f"no executor for {a}")

    # --- votes and commits -----------------------------------------------------------------
    def _vote(self, a: CastVote) -> None:
        view = self._view
        assert view is not None
        t0 = time.monotonic()
        got = self.coord.vote(
            a.epoch, a.step, len(view.members), leaving=a.want_drain, joining=a.joining
        )
        while got is None:
            got = self.coord.await_decision(a.epoch, a.step)
            if self._closing:
                break
            self._hb.beat()
        commit = got is not None and got[:1] == COMMIT
        admit = commit and got == COMMIT + ADMIT
        if commit and view.index(self.rank) == 0 and a.step > 0:
            self._garbage.put((a.epoch, a.step - 1))  # every member has read it by now
        wait_ms = round((time.monotonic() - t0) * 1e3, 3)
        if commit and not admit:  # the fault-free path: one line per step, the commit's
            self._decision_wait_ms = wait_ms
        else:
            self.events.emit(
                "decision",
                epoch=a.epoch,
                step=a.step,
                decision="commit" if commit else "rollback",
                reason=None if commit or got is None else got[1:],
                admit=admit,
                wait_ms=wait_ms,
            )
        self._feed(Decision(commit=commit, admit=admit))

    def _collect(self) -> None:
        """Thread: delete the keys of decided steps off the training path (the side
        store's connection, shared with rollback proposals under its lock)."""
        while True:
            item = self._garbage.get()
            if item is None:
                return
            try:
                with self._side_lock:
                    Coordinator.forget_keys(self._side_store, self.keys, *item)
            except Exception:  # noqa: BLE001 - a leftover key costs a few bytes
                log.debug("store gc: could not delete the keys of %s", item, exc_info=True)

    def _apply_commit(self, a: ApplyCommit) -> None:
        self.injector.fire_due(a.step, point="commit")  # tests: death after the decision
        opt = self.registry.optimizer
        with self.interrupter.atomic():
            if opt is not None:
                opt.step()
            self.registry.zero_grads()
        self.commits += 1
        if self._heal_pg is not None:
            # every member voted, so every heal of the epoch is over on both of its ends
            # (the sender's side can finish before the receiver's): the group can go
            self._release_heal_pg(pending=False)
        self._hb.tracking = True
        every = self.config.check_every
        digest = self.registry.digest(a.step + 1) if every and (a.step + 1) % every == 0 else None
        share = list(self._share) if self._share is not None else None
        extra: dict[str, Any] = {}
        if self._adding_kept is not None and share is not None:
            extra["kept"] = [*self._adding_kept, share[2]]
        self.events.emit(
            "commit",
            epoch=self._fsm.epoch,
            step=a.step,
            digest=digest,
            shard=share,
            wait_ms=self._decision_wait_ms,
            **extra,
        )
        self._decision_wait_ms = None
        self._feed(CommitApplied())

    # --- epochs and healing ----------------------------------------------------------------
    def _cancelled(self, phase: Phase) -> Callable[[], bool]:
        """A check for long main-thread waits: true once the job closes or the state
        machine left ``phase``, even if it came back to it meanwhile (a fault during a
        formation or a process-group build queues a new one; the old wait is stale)."""
        changes = self._action_gen

        def check() -> bool:
            self._hb.beat()
            return self._closing or self._fsm.phase is not phase or self._phase_changes != changes

        return check

    def _announce_join(self) -> None:
        self.bus.broadcast(
            JoinRequest(job=self.config.job, epoch=0, rank=self.rank, incarnation=self.incarnation)
        )

    def _join(self) -> None:
        self.events.emit("join_wait", incarnation=self.incarnation)
        t0 = time.monotonic()
        try:
            view = self.coord.form_as_joiner(
                start_timeout_s=self.config.start_timeout_s,
                cancelled=self._cancelled(Phase.INIT),
                announce=self._announce_join,
            )
        except JobFinished as e:
            self.events.emit("job_finished", step=e.step)
            log.warning("%s", e)
            self.close()
            raise
        if view is not None:
            self._adopt(view, waited_s=time.monotonic() - t0)

    def _form(self, a: FormEpoch) -> None:
        prev = self._view
        assert prev is not None
        t0 = time.monotonic()
        exclude = a.exclude | frozenset(m.rank for m in prev.members if m in self._dead)
        try:
            view = self.coord.form_as_survivor(
                prev,
                exclude,
                step=self._fsm.step,
                lost_state=a.lost_state,
                timeout_s=self.config.rollback_timeout_s,
                cancelled=self._cancelled(Phase.HEALING),
                kept=self._kept[1:] if self._kept and self._kept[0] == self._fsm.step else None,
                # elastic: the retry goes on without workers still to heal (admitted after
                # the next commit); a fixed world cannot step without them
                admit=not (a.rollback and self.config.elastic),
            )
        except JobFinished as e:
            self.events.emit("job_finished", step=e.step)
            log.warning("the job finished at step %d while this worker re-formed", e.step)
            self.close()
            raise
        if view is None:
            return
        if not view.has(self.rank, self.incarnation):
            self.events.emit("excluded", epoch=view.epoch)
            with self._lock:
                self._feed_locked(QuorumReady(view.epoch, view.ranks, view.step, view.needs_state))
            return
        self._adopt(view, waited_s=time.monotonic() - t0)

    def _adopt(self, view: EpochView, waited_s: float) -> None:
        self.events.emit(
            "epoch",
            epoch=view.epoch,
            members=[m.rank for m in view.members],
            step=view.step,
            needs_state=sorted(view.needs_state),
            source=view.source,
            form_ms=round(waited_s * 1e3, 3),
            **({"kept": [list(k) for k in view.kept]} if view.kept else {}),
            **({"waiting": list(view.waiting)} if view.waiting else {}),
        )
        with self._lock:
            self._view = view
            ready = QuorumReady(
                view.epoch,
                view.ranks,
                view.step,
                view.needs_state,
                waiting=bool(view.waiting),
                source=view.source if self._heal_apart() else None,
            )
            self._feed_locked(ready)
            for m in view.members:  # deaths we heard of while the epoch was being formed
                if m in self._dead and m != self.me:
                    self._feed_locked(PeerFault(m.rank, Severity.FAULT1, "died during formation"))

    def _comm_device(self) -> torch.device:
        """Where this epoch's collectives take tensors: NCCL needs them on the model's GPU."""
        if self._backend() == "nccl":  # pragma: no cover - GPU machines only
            return self._gpu() or torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gpu(self) -> torch.device | None:
        """The GPU of the registered model, None if it has none."""
        model = self.registry.model
        for p in model.parameters() if model is not None else ():
            if p.device.type == "cuda":
                return p.device
        return None

    def _backend(self) -> str:
        """The configured backend; ``auto`` is decided once, at ``register(model=...)``
        (or at the first process group when no model is registered), from where the
        model lives (:func:`choose_backend`)."""
        if self._backend_chosen is None:
            model = self.registry.model
            devices = {p.device.type for p in model.parameters()} if model is not None else set()
            self._backend_chosen, why = choose_backend(
                self.config.backend,
                devices,
                local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                gpus=torch.cuda.device_count() if "cuda" in devices else 0,
            )
            if why:
                log.warning("backend: %s", why)
        return self._backend_chosen

    def _heal_apart(self) -> bool:
        """Whether a heal runs in a group of its own (the source and the members it heals)
        while the other members go on with the step. On Gloo, where a group costs a few
        ms and the other members would otherwise receive the whole state for nothing
        (and take CPU from the two that need it). On NCCL a communicator costs ~100 ms, so
        the heal stays one broadcast over the epoch's group."""
        return self._backend() != "nccl"

    def _release_heal_pg(self, *, pending: bool) -> None:
        """Let the heal group go: kept, never destroyed, when an operation may still be
        pending on it (as an abandoned epoch group); else destroyed off the main thread."""
        if self._heal_pg is None:
            return
        held = [self._heal_pg[1]]
        self._heal_pg = None
        self._heal_tail = None  # abandoned with it, or already finished
        if pending:
            self._abandoned.extend(held)
            exit_without_destructors_later()
        else:
            _drop_later(held)

    def _heal_ranks(self, view: EpochView) -> list[int] | None:
        """The heal group of ``view`` (source first) when this member is in one."""
        if not view.needs_state or view.source is None or not self._heal_apart():
            return None
        ranks = [view.source, *sorted(view.needs_state - {view.source})]
        return ranks if self.rank in ranks else None

    def _build_pg(
        self, prefix: str, rank: int, size: int, name: str, *, own_store: bool = False
    ) -> cf.Future[Any]:
        """Build a process group in a daemon thread: connecting to a member that died
        meanwhile blocks in C++ until the timeout, and the death must be able to cancel
        the wait. ``own_store``: over a connection of its own, for a group built while
        another is: a store client serialises its requests, so one group's blocking
        ``get`` would hold back the other's ``set`` that a peer waits for (a deadlock
        until the timeout)."""
        timeout = datetime.timedelta(seconds=self.config.pg_timeout_s)
        backend = self._backend()
        fut: cf.Future[Any] = cf.Future()

        def run() -> None:
            try:
                client = self._store.clone() if own_store else self._store  # type: ignore[attr-defined]
                store = dist.PrefixStore(prefix, client)
                if backend == "nccl":  # pragma: no cover - checked on a GPU machine only
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = timeout
                    fut.set_result(dist.ProcessGroupNCCL(store, rank, size, opts))
                else:
                    fut.set_result(dist.ProcessGroupGloo(store, rank, size, timeout))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                fut.set_exception(e)

        threading.Thread(target=run, name=name, daemon=True).start()
        return fut

    def _configure_pg(self, a: ConfigureProcessGroup) -> None:
        view = self._view
        assert view is not None and view.epoch == a.epoch
        t0 = time.monotonic()
        prefix = self.keys.pg_prefix(a.epoch)
        size = len(view.members)
        futs = [self._build_pg(prefix, view.index(self.rank), size, f"fastft-pg-{a.epoch}")]
        heal = self._heal_ranks(view)
        if heal is not None:  # built alongside, not after: the heal waits for both
            futs.append(
                self._build_pg(
                    prefix + "heal/",
                    heal.index(self.rank),
                    len(heal),
                    f"fastft-pg-{a.epoch}-heal",
                    own_store=True,
                )
            )
        cancelled = self._cancelled(self._fsm.phase)
        groups: list[Any] = []
        for fut in futs:
            while True:
                try:
                    groups.append(fut.result(timeout=_WAIT_S))
                    break
                except cf.TimeoutError:
                    if cancelled() or self._fsm.epoch != a.epoch:
                        self._abandoned.extend(groups)
                        return
                except Exception as e:
                    self._abandoned.extend(groups)
                    self._local_fault(e, gen=self._action_gen)
                    return
        if self._pg is not None:  # the last epoch's, after a commit: nothing is pending
            done = [self._pg]
            self._pg = None
            _drop_later(done)
        self._pg, self._pg_epoch = groups[0], a.epoch
        self._heal_pg = (a.epoch, groups[1]) if heal is not None else None
        self.events.emit(
            "process_group",
            epoch=a.epoch,
            backend=self._backend(),
            size=size,
            build_ms=round((time.monotonic() - t0) * 1e3, 3),
            **({"heal_group": heal} if heal is not None else {}),
        )

    def _heal(self, a: FetchState | SendState) -> None:
        view = self._view
        assert view is not None and view.source is not None
        if self._pg is None or self._pg_epoch != a.epoch:
            return  # the process group was not built (cancelled): the fsm moved on
        self.injector.fire_due(a.step, point="heal")  # tests: death while healing
        t0 = time.monotonic()
        sending = self.rank == view.source
        receiving = isinstance(a, FetchState) or self.rank in view.needs_state
        pg, src = self._pg, view.index(view.source)
        apart = False
        if self._heal_pg is not None and self._heal_pg[0] == a.epoch:
            pg, src, apart = self._heal_pg[1], 0, True  # the source and the members it heals
        self.interrupter.begin_step(a.epoch, a.step)  # a fault of this epoch ends the heal
        tail: list[dist.Work] = []
        try:
            # a small header (the state with tensors referenced, and their layout), then
            # the wires (StateRegistry.pack): one buffer of the small tensors per device,
            # and each large tensor as a byte view of its own storage. In a heal group of
            # its own, the optimizer's large tensors go last and follow while the step
            # runs (_finish_heal_tail): only the vote needs them.
            header, flats = self.registry.pack(a.step, defer=apart) if sending else (b"", [])
            t_packed = time.monotonic()
            dev = self._comm_device()
            with self._waiting():
                header = interruptible_broadcast_bytes(
                    pg, header if sending else None, src, self.interrupter, device=dev
                )
                t_header = time.monotonic()
                if not sending:
                    flats = StateRegistry.allocate(header, cuda=self._gpu())
                first = StateRegistry.tail(header)
                if any(f.device != dev for f in flats[first:]):
                    first = len(flats)  # pragma: no cover - GPU state over Gloo: in line
                for flat in flats[:first]:
                    wire = flat if flat.device == dev else flat.to(dev)
                    interruptible_broadcast(pg, [wire], src, self.interrupter)
                    if wire is not flat:  # pragma: no cover - NCCL: CPU state via the GPU
                        flat.copy_(wire)
                self.interrupter.check()
                tail = [start_broadcast(pg, [flat], src) for flat in flats[first:]]
        except (StepInterrupted, Exception) as e:
            self._release_heal_pg(pending=True)  # it may still be inside the broadcast
            self.events.emit("heal_aborted", epoch=a.epoch, reason=str(e)[:300])
            if not isinstance(e, StepInterrupted):
                self._local_fault(e, gen=self._action_gen)
            return
        finally:
            self.interrupter.end_step()
        t_sent = time.monotonic()
        if receiving:
            step = self.registry.load_packed(header, flats, part="head" if tail else "all")
            assert step == view.step, (step, view.step)
        t1 = time.monotonic()

        def ms(d: float) -> float:
            return round(d * 1e3, 3)

        self.events.emit(
            "heal",
            epoch=a.epoch,
            step=a.step,
            role="send" if sending else ("fetch" if receiving else "relay"),
            bytes=len(header) + sum(f.numel() * f.element_size() for f in flats),
            heal_ms=ms(t1 - t0),
            # where it went: packing the state, the header's collective, the state's, loading
            pack_ms=ms(t_packed - t0),
            header_ms=ms(t_header - t_packed),
            transfer_ms=ms(t_sent - t_header),
            load_ms=ms(t1 - t_sent),
            # the optimizer state's bytes that follow while the step runs
            tail_bytes=sum(f.numel() * f.element_size() for f in flats[len(flats) - len(tail) :]),
        )
        with self._lock:
            if tail:
                if self._heal_pg is None or self._heal_pg[0] != a.epoch:
                    return  # a fault released the group (and ended the epoch) meanwhile
                self._heal_tail = _HealTail(a.epoch, header, flats, tail, receiving, t1)
            self._feed_locked(HealDone(pending=bool(tail) and receiving))

    def _finish_heal_tail(self) -> None:
        """Before the vote: wait for the optimizer state a heal sent while the step ran and,
        on a member that received it, load it (S4: no vote without the whole state).
        Raises StepInterrupted on a fault meanwhile, which abandons it (the next epoch
        heals this member again: it still counts as having lost its state)."""
        tail = self._heal_tail
        if tail is None:
            return
        t0 = time.monotonic()
        with self._waiting():
            for work in tail.works:
                wait_work(work, self.interrupter)
        waited = time.monotonic() - t0
        if tail.receiving:
            self.registry.load_packed(tail.header, tail.flats, part="tail")
        with self._lock:
            if self._heal_tail is not tail:
                self.interrupter.check()  # released by a fault that ended the step
                return
            self._heal_tail = None
            if tail.receiving and self._fsm.phase is Phase.NORMAL and self._fsm.epoch == tail.epoch:
                self._feed_locked(StateLoaded())
        self.events.emit(
            "heal_tail",
            epoch=tail.epoch,
            role="fetch" if tail.receiving else "send",
            # the step's own work done meanwhile, and what the vote then waited for
            overlap_ms=round((t0 - tail.started) * 1e3, 3),
            wait_ms=round(waited * 1e3, 3),
            load_ms=round((time.monotonic() - t0 - waited) * 1e3, 3),
        )

    def _inject(self, spec: FaultSpec) -> None:
        self.events.emit(
            "injected",
            kind=spec.kind.value,
            point=spec.point,
            step=self._fsm.step,
            epoch=self._fsm.epoch,
            incarnation=self.incarnation,
        )
        if spec.kind is FaultKind.STATE_LOST:
            # make the loss real: a worker that failed to heal ends with a wrong digest
            with torch.no_grad():
                for t in self.registry.model.parameters() if self.registry.model else ():
                    t.fill_(float("nan"))
        execute(spec)

    # --- the bus ---------------------------------------------------------------------------
    def _on_message(self, m: Message) -> None:
        if isinstance(m, Inject):
            self.injector.on_message(m)
            return
        view = self._view
        if isinstance(m, Fault | ProcessExited | HangSuspected):
            if isinstance(m, Fault):
                r, inc, sev, cause = m.faulty_rank, m.faulty_incarnation, m.severity, m.cause
            elif isinstance(m, ProcessExited):
                r, inc, sev = m.exited_rank, m.exited_incarnation, Severity.FAULT1
                how = f"signal {m.signal}" if m.signal is not None else f"code {m.exit_code}"
                cause = f"rank {r} exited ({how})"
                if m.exit_code == 0 and self._job_finished():
                    # It finished the job after the last step, which this worker voted for
                    # too and is still applying: an end, not a fault.
                    self.events.emit("peer_finished", rank=r, incarnation=inc)
                    return
            else:
                r, inc, sev = m.hung_rank, m.hung_incarnation, Severity.FAULT1
                cause = f"rank {r} {'stopped' if m.stopped else 'hung'}"
            if r == self.rank and inc in (0, self.incarnation):
                if isinstance(m, Fault) and m.sender != (self.rank, self.incarnation):
                    # a monitor or an operator reports this worker faulty
                    self._feed(LocalFault(sev, f"reported by {m.role.name.lower()}: {cause}"[:200]))
                return
            self_reported = isinstance(m, Fault) and m.sender == (r, inc)
            if sev is Severity.FAULT1 and inc and not self_reported:
                # dead (exited, hung, declared dead); a worker that reports its own Fault1
                # lost its state but lives: it re-forms with the others and heals
                if Member(r, inc) in self._dead:
                    # one death, several messages (stopped, then killed; declared dead,
                    # then exited): the first one already started the recovery
                    log.debug("rank %d incarnation %d: already known dead (%s)", r, inc, cause)
                    return
                self._dead.add(Member(r, inc))
                self.coord.dead.add(Member(r, inc))
            if view is not None and r in view.ranks and inc in (0, view.incarnation(r)):
                self.events.emit(
                    "peer_fault",
                    rank=r,
                    incarnation=inc,
                    severity=sev.name,
                    cause=cause[:300],
                    kind=type(m).__name__,
                    sent=m.wall_time,
                    epoch=self._fsm.epoch,
                    step=self._fsm.step,
                )
                self._feed(PeerFault(r, sev, cause[:200]))
            return
        if view is None or m.rank == self.rank:
            return  # not in an epoch yet (joins are admitted by the formation), or our own
        member = view.has(m.rank, m.incarnation)
        if isinstance(m, RollbackRequest):
            if member and m.epoch == self._fsm.epoch:
                self._feed(RollbackRequested(m.rank))
        elif isinstance(m, RollbackAck):
            if member and m.epoch == self._fsm.epoch:
                self._feed(RollbackAcked(m.rank))
        elif isinstance(m, DrainNotice):
            if member:
                self._feed(DrainNoticed(m.rank))
        elif isinstance(m, DrainAck):
            if m.drained_rank == self.rank:
                self._feed(DrainAcked(m.rank))
        elif isinstance(m, JoinRequest):
            self._feed(JoinRequested(m.rank))

    # --- helpers ---------------------------------------------------------------------------
    def _job_finished(self) -> bool:
        """Whether a member marked the job finished (it closed after a committed step)."""
        try:
            with self._side_lock:
                return bool(self._side_store.check([self.keys.finished]))
        except Exception:  # noqa: BLE001 - then a clean exit counts as a fault, as before
            log.debug("could not read the job's finished mark", exc_info=True)
            return False

    def _waiting(self) -> _Blocked:
        return self._hb.blocked


@dataclass
class _HealTail:
    """The deferred part of a heal (:meth:`Runtime._heal`): the optimizer state's works,
    started when the rest was in, and what loading it needs."""

    epoch: int
    header: bytes
    flats: list[torch.Tensor]
    works: list[Any]
    receiving: bool
    started: float


class _Blocked:
    """``with hb.blocked:`` the main thread is blocked in an interruptible wait: the
    heartbeat thread keeps beating for it (the agent must not take a waiting worker for a
    hung one). One reusable object per heartbeat."""

    def __init__(self, hb: Heartbeat) -> None:
        self.hb = hb

    def __enter__(self) -> None:
        self.hb.waiting(True)

    def __exit__(self, *exc: object) -> None:
        self.hb.waiting(False)


class Heartbeat:
    """Progress for the agent's hang detector, in a small shared file: CLOCK_MONOTONIC of
    the last sign of life, and the longest gap between beats seen lately (0 until the first
    commit), which an agent with ``--adaptive-hang`` scales into its timeout. The main
    thread beats at every step boundary and wait loop; while it is blocked in an
    interruptible wait a helper thread beats for it. A main thread that holds the GIL or
    loops without returning stops the beats."""

    _FMT = "<dd"
    _DECAY = 0.999  # per beat: the longest gap fades over a few thousand beats

    def __init__(self, path: str | None) -> None:
        self._mm: mmap.mmap | None = None
        self._waiting = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prev = 0.0
        self._gap = 0.0
        self.tracking = False
        """Set after the first commit: gaps before it (start-up, healing) are not steps."""
        self.blocked = _Blocked(self)
        if path:
            size = struct.calcsize(self._FMT)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
            os.close(fd)
            self.beat()
            self._thread = threading.Thread(target=self._run, name="fastft-heartbeat", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        if self._mm is None:
            return
        now = time.monotonic()
        if self.tracking and self._prev:
            self._gap = max(now - self._prev, self._gap * self._DECAY)
        self._prev = now
        self._mm[0:16] = struct.pack(self._FMT, now, self._gap)

    def waiting(self, on: bool) -> None:
        (self._waiting.set if on else self._waiting.clear)()
        self.beat()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if self._waiting.is_set():
                self.beat()

    EXIT_GRACE_S = 60.0
    """After close, the agent gives the process this long to exit before it calls it hung
    (interpreter teardown, torch's thread joins: seconds on a loaded machine, no beats)."""

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self._mm is not None:
            # A last beat in the future: the worker is leaving, not hung.
            self._mm[0:16] = struct.pack(self._FMT, time.monotonic() + self.EXIT_GRACE_S, 0.0)
            self._mm.close()
            self._mm = None


def read_heartbeat(path: str) -> tuple[float, float] | None:
    """(last beat in CLOCK_MONOTONIC seconds, longest recent gap between beats; 0 before
    the first commit) from ``path``; None if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(16)
        return struct.unpack("<dd", data) if len(data) == 16 else None
    except OSError:
        return None


_JOIN = Action()


def _drop_later(groups: list[Any]) -> None:
    """Destroy process groups in a thread of their own: a Gloo group's destructor takes
    ~20 ms here (its threads' shutdown), on whichever thread drops the last reference.
    ``groups`` must hold the only references: the caller gives them up."""
    threading.Thread(target=groups.clear, name="fastft-pg-drop", daemon=True).start()


_exit_status = [0]
_hooked = [False]


def exit_without_destructors_later() -> None:
    """An abandoned process group may still own an operation stuck on a dead peer; its
    C++ destructor at interpreter shutdown would abort the process (std::terminate). Once
    a group was abandoned, end the process at exit without running destructors, keeping
    the exit status (1 after an uncaught exception)."""
    if _hooked[0]:
        return
    _hooked[0] = True
    prev_hook = sys.excepthook

    def hook(*args: Any) -> None:
        _exit_status[0] = 1
        prev_hook(*args)

    sys.excepthook = hook

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])

    atexit.register(leave)


def _ran_ahead() -> bool:
    """Whether this process is a warm spare that ran the script up to ``fastft.init()``."""
    spare = sys.modules.get("fastft.launch.spare")
    return bool(spare is not None and spare.ran_ahead)


def init(config: RuntimeConfig | None = None, **overrides: Any) -> Runtime:
    """Start fastft in this worker: reads what ``fastft run`` put in the environment (or
    ``config``), connects to the job's store and joins its error bus. Then call
    :meth:`Runtime.register` with the model and optimizer."""
    if os.environ.get(SPARE_RUN_AHEAD):  # a warm spare that ran the script ahead:
        from fastft.launch.spare import await_order

        await_order()  # it becomes its worker here
    if config is None:
        config = RuntimeConfig.from_env(**overrides)
    return Runtime(config)
