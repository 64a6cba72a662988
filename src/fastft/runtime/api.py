"""The worker's API: :func:`init`, :class:`Runtime` and :class:`Transaction`.

One :class:`Runtime` per process. Its brain is the pure state machine
(:func:`fastft.fsm.decide`), run by :class:`fastft.runtime.engine.executor.Executor`. The main
thread is interrupted (``fastft.interrupt``) only inside the user's step body; the
runtime's own machinery is shielded from the signal and checks the state machine at its
own safe points instead.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

import fastft.process.malloc as malloc
from fastft.bus import connect_store, node_voice
from fastft.bus.signed import SignedStore
from fastft.fsm import DrainRequested, Phase, StepState
from fastft.interrupt import Interrupter, StepInterrupted
from fastft.process.env import SPARE_RUN_AHEAD, insecure
from fastft.process.events import EventLog
from fastft.process.heartbeat import HeartbeatWriter
from fastft.process.order import await_order, ran_ahead, was_spare
from fastft.process.services import Services
from fastft.process.teardown import arm_fast_exit
from fastft.protocol import JobKeys
from fastft.protocol.auth import JobSecret, ValueAuth
from fastft.protocol.exits import ending_path
from fastft.runtime import closing
from fastft.runtime.agreement import Agreement
from fastft.runtime.attempt import StepAttempts
from fastft.runtime.contract import Member, RuntimeConfig
from fastft.runtime.endings import Drained, JobFinished, ScriptError, WorkerExit
from fastft.runtime.engine.build import build_engine
from fastft.runtime.engine.coordinator import DECISION_WAIT_S
from fastft.runtime.engine.core import Core
from fastft.runtime.engine.executor import Executor
from fastft.runtime.groups.flow import flow_of
from fastft.runtime.groups.hsdp import StepGate, meet_shard_group
from fastft.runtime.health import HealthCheck, admit_or_leave
from fastft.runtime.restart import Restartable
from fastft.runtime.state.data import Batches
from fastft.runtime.state.outer import Outer, OuterOptimizer
from fastft.runtime.state.registry import StateRegistry
from fastft.runtime.sync import reduce_gradients as sync_gradients
from fastft.runtime.transaction import Transaction

__all__ = ["Runtime", "Transaction", "init"]  # (Transaction: fastft.runtime.transaction)

log = logging.getLogger(__name__)

T = TypeVar("T")


class Runtime:
    """fastft on one worker. Build it with :func:`init`."""

    def __init__(self, config: RuntimeConfig, *, store: dist.Store | None = None) -> None:
        malloc.tune()  # steps that do not depend on what the process freed before
        self._t0 = time.time()
        self.config = config
        self.rank = config.rank
        self.incarnation = config.incarnation or (secrets.randbits(62) | 1)
        self.me = Member(self.rank, self.incarnation)
        self.keys = JobKeys(config.job)
        self.events = EventLog(config.run_dir, f"rank {self.rank}")
        self.registry = StateRegistry()
        store = store if store is not None else connect_store(config.store)
        control: Any = store  # (FASTFT_INSECURE_NO_AUTH: values without tags)
        secret = None if insecure() else JobSecret.for_worker(config.secret_file)
        if secret is not None:
            control = SignedStore(store, self.keys, ValueAuth(secret))
        decisions = control.clone()
        decisions.set_timeout(datetime.timedelta(seconds=DECISION_WAIT_S))
        self.interrupter = Interrupter().install()
        if threading.current_thread() is threading.main_thread() and config.shard_size == 1:
            # a preemption notice, or the agent draining its node: leave after the next
            # commit (ft.drain); a second SIGTERM, or the agent's grace, ends it anyway
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if threading.current_thread() is threading.main_thread() and config.heartbeat_file:
            # under `fastft run`, Ctrl-C reaches the agent and every worker alike: the
            # agent stops the job; a worker's KeyboardInterrupt would only add tracebacks
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.interrupter.end_step()
        self.flow = flow_of(config, secret)  # (pipeline stages: --stage, --flow)
        x = self.engine = build_engine(
            config,
            self.me,
            self.keys,
            store,
            control,
            decisions,
            self.registry,
            self.interrupter,
            self.events,
            self.flow,
        )
        self.interrupter.shield(
            StepAttempts.enter,
            StepAttempts.exit,
            Executor.drive,
            Core.run,
            Runtime.close,
        )
        self.control = control  # (the job's store as this worker writes to it: signed)
        self._raw_store = store
        self._mesh: Any = None
        self.registered = False
        self.attempts = StepAttempts(self)
        self.health_checks: list[tuple[str, HealthCheck]] = []
        """The user's health checks (:meth:`add_health_check`)."""
        sv = Services.start(
            store,
            config,
            rank=self.rank,
            incarnation=self.incarnation,
            label=f"rank {self.rank}",
            on_message=x.faults.on_message,
            fire=x.faults.inject,
            events=self.events,
        )
        x.attach(sv)
        x.coord.voice = node_voice(sv.bus)  # (under a bus relay: its agent speaks for it)
        self.bus = sv.bus
        self.injector = sv.injector
        self.heartbeat: HeartbeatWriter = sv.heartbeat
        self.events.emit(
            "worker_start",
            incarnation=self.incarnation,
            life=config.life,
            pid=os.getpid(),
            ran_ahead=ran_ahead(),
            spare=was_spare(),
        )
        arm_fast_exit(  # (registered first: runs after _stop_threads)
            ending_path(config.run_dir, self.rank, self.incarnation) if config.run_dir else None
        )
        atexit.register(self._stop_threads)

    def _stop_threads(self) -> None:
        closing.stop_threads(self)

    # --- public API ------------------------------------------------------------------------
    def register(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        outer_optimizer: OuterOptimizer | None = None,
        step: int | None = None,
        **others: Any,
    ) -> Runtime:
        """Register what a step changes and a heal transfers, then join the job: returns
        once this worker is a member of an epoch and holds the committed state.
        ``outer_optimizer`` (``--sync diloco``): builds the outer optimizer over a list of
        tensors (default: Nesterov SGD, lr 0.7, momentum 0.9). ``step``: the state of
        this step, loaded by the script from a checkpoint of its own: a job that starts
        (or again after losing every worker) goes on from it, unless the durable tier
        holds a newer one."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"ft.register(step={step!r}): the saved state's step, an int >= 0")
        self.registry.resume = step
        if self.sharded and self._mesh is None:
            raise RuntimeError(
                "this worker is in a shard group (--shard-size): shard the model over "
                "ft.shard_mesh() (fully_shard(model, mesh=ft.shard_mesh())) before ft.register"
            )
        try:
            self.registry.register(model, optimizer, **others)
        except TypeError as e:  # (what a heal could not carry, a scheduler left out)
            self.refuse(f"ft.register: {e}", e)
        if self.config.sync_kind == "diloco" and model is not None:
            self.registry.outer = Outer(self.registry.local_parameters(), outer_optimizer)
        elif outer_optimizer is not None:
            raise ValueError("outer_optimizer: only with --sync diloco:N")
        for name, obj in others.items():
            if isinstance(obj, Batches):
                obj.guard = self.interrupter.atomic
                self.attempts.agreement.batches.append(obj)
            elif type(obj).__name__ == "StatefulDataLoader":
                log.warning(
                    "register(%s=StatefulDataLoader): register fastft.Batches(loader) and draw "
                    "with .next() instead; a loader iterated directly can be torn by an "
                    "interrupt and loses its worker processes at every rollback",
                    name,
                )
        if model is not None:
            self.engine.dp.backend()  # a backend that cannot work with this model fails here
        admit_or_leave(self, check_state=True)  # (fastft.runtime.health: raises Unhealthy)
        self.registered = True
        self.drive(lambda s: s.phase is Phase.NORMAL)
        x, durable = self.engine, self.engine.durable
        if durable is not None and x.view is not None and x.view.members[0] == self.me:
            durable.prepare()  # the writer's imports run with the first steps, not the first save
        self.heartbeat.between(True)  # (the user's code until its first step)
        return self

    def refuse(self, why: str, cause: BaseException | None = None) -> None:
        """End this worker with :class:`ScriptError`: the script registered or did what
        cannot work, and a restart would do it again (the job fails at once, saying why)."""
        self.events.emit("script_error", step=self.step, error=why)
        log.critical("%s", why)
        raise ScriptError(why) from cause

    def add_health_check(self, check: HealthCheck, name: str | None = None) -> None:
        """Add a check this worker runs before it joins (:meth:`register`, so add it
        before) and before an in-process restart rejoins (:meth:`run`): it passes when it
        returns None or True, fails when it returns False or a reason (a string) or raises.
        A worker that fails one is not admitted (:mod:`fastft.runtime.health`)."""
        self.health_checks.append((name or str(getattr(check, "__name__", "user")), check))

    def run(self, fn: Callable[..., T], *args: Any, **options: Any) -> T:
        """Run ``fn(*args)`` (the training loop, after :meth:`register`) and restart it in
        this process when an exception escapes every transaction: the worker leaves its
        epoch, heals from a peer if its state may be damaged, and calls ``fn`` again at
        the committed step (:mod:`fastft.runtime.restart`). ``options``: ``on_fault(exc)``,
        ``health_check()``, ``before_restart()``, ``finalize()``, ``max_restarts`` (3)
        within ``window_s`` (600), ``heal`` ('auto', True, False), ``soft_timeout_s``,
        ``hard_timeout_s``. Returns what ``fn`` returns."""
        return cast(T, Restartable(self, fn, **options)(*args))

    @property
    def sharded(self) -> bool:
        """Whether this worker is a member of a shard group (``--shard-size`` > 1)."""
        return self.config.shard_size > 1

    @property
    def vote(self) -> Agreement:
        return self.attempts.agreement

    def shard_mesh(self, device_type: str | None = None) -> Any:
        """The 1-D ``DeviceMesh`` of this worker's shard group (``--shard-size K``): shard
        the model over it with FSDP2 before :meth:`register`, as torch's own HSDP does::

            model = fully_shard(model, mesh=ft.shard_mesh())

        The replicate dimension is fastft's (:mod:`fastft.runtime.groups.hsdp`). ``device_type``:
        ``cuda`` when CUDA is available, else ``cpu``."""
        if not self.sharded:
            raise RuntimeError(
                "ft.shard_mesh(): this job has no shard groups; start it with "
                "`fastft run --shard-size K` (K workers shard one copy of the model)"
            )
        if self._mesh is None:
            with self.heartbeat.blocked:  # (waits for the group's other members to start)
                self._mesh = meet_shard_group(self.config, self._raw_store, device_type)
            self.engine.dp.set_gate(StepGate(self.heartbeat.blocked))
            cfg = self.config
            self.events.emit("shard_group", group=self.rank // cfg.shard_size, gen=cfg.group_gen)
        return self._mesh

    @property
    def step(self) -> int:
        """Number of committed steps (the step the next transaction runs)."""
        return self.engine.state.step

    @property
    def epoch(self) -> int:
        return self.engine.state.epoch

    @property
    def elapsed_s(self) -> float:
        """Seconds since the job began (its first agent's start, the same on every node and
        across restarts: a restarted worker's rate figures go on from the job's, not its
        own); without ``fastft run``, since ``init()``."""
        return time.time() - (self.config.job_started or self._t0)

    @property
    def world(self) -> int:
        view = self.engine.view
        return len(view.members) if view else 0

    @property
    def commits(self) -> int:
        return self.engine.commits

    @property
    def rollbacks(self) -> int:
        return self.engine.rollbacks

    def transaction(self) -> Transaction:
        """``with ft.transaction() as tx:`` one step: commits on every member or on none."""
        return Transaction(self, self.attempts)

    def no_hang_check(self) -> Any:
        """A context manager for long work between steps (evaluation, a checkpoint): the
        heartbeat goes on while it runs, so the agent's hang timeout (adaptive or not)
        does not kill the worker. A real hang inside it is not detected."""
        return self.heartbeat.blocked

    def digest(self) -> str:
        """Hash of the replicated state at the current step (S3)."""
        return self.registry.digest(self.step)

    def close(self, *, finished: bool = True) -> None:
        """Leave the job. Idempotent. ``finished=False``: this worker leaves on its own
        (a failed health check); a member's close otherwise tells joiners the job ended."""
        closing.close(self, finished=finished)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, et: object, *exc: object) -> None:
        self.close(finished=et is None)  # (an exception is no end of the job)

    # --- the step --------------------------------------------------------------------------
    def drive(
        self,
        done: Callable[[StepState], bool],
        *,
        settled: Callable[[StepState], bool] | None = None,
    ) -> None:
        try:
            with self.heartbeat.blocked:  # (waits for the runtime: a recovery, a formation)
                self.engine.drive(done, settled=settled)
        except JobFinished:
            self.close()
            raise
        except WorkerExit as e:
            s = self.engine.state
            if s.want_drain:  # every member let it go: end as drained
                # (the state's reason is the drain's after its commit; in a formation or a
                # join, the fault's the epoch re-forms for: "drained: rank 1 hung" misled)
                leaving = s.phase in (Phase.HEALING, Phase.INIT)
                why = (None if leaving else s.reason) or str(e)
                self.events.emit("drained", step=self.engine.state.step, reason=why)
                self.close(finished=False)  # (it leaves; the job goes on)
                raise Drained(why) from None
            raise

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """A preemption notice: drain, and if that has not ended the worker within the
        grace (``--drain-grace``), end it as a second SIGTERM does (the default action)."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.drain("SIGTERM")
        grace = threading.Timer(
            self.config.drain_grace_s, os.kill, args=(os.getpid(), signal.SIGTERM)
        )
        grace.daemon = True
        grace.start()

    def drain(self, reason: str = "ft.drain()") -> None:
        """Leave the job after the next commit, with nothing rolled back: the peers
        re-form without this worker, which then ends (:class:`Drained`, exit status
        ``EXIT_DRAINED``). A SIGTERM to the worker does the same (a preemption notice);
        so does ``fastft drain --rank R``. Returns at once; the step loop goes on until
        the commit."""
        if self.sharded:
            raise RuntimeError(
                "ft.drain(): a drain of one member of a shard group is not built; the "
                "group is the unit (stop the job, or let the member fail)"
            )
        threading.Thread(
            target=self.engine.feed, args=(DrainRequested(reason[:200]),), daemon=True
        ).start()  # (not under the caller's frame: a signal handler may call this)

    def reduce_gradients(self, model: nn.Module | None) -> None:
        if model is not None and self.registry.model is None:
            self.registry.register(model=model)
        sync_gradients(self)

    def require_pg(self) -> Any:
        self.interrupter.check()
        pg = self.engine.dp.pg
        if pg is None:
            s = self.engine.state
            if s.phase is not Phase.NORMAL:  # a peer's fault tore the epoch's group down
                # (before this step's interrupt: part of that fault, not one of this rank's)
                why = f"the process group of epoch {s.epoch} is gone ({s.phase.name})"
                raise StepInterrupted(why, epoch=s.epoch, step=s.step)
            raise RuntimeError("no process group: collectives run inside ft.transaction()")
        return pg


def init(config: RuntimeConfig | None = None, **overrides: Any) -> Runtime:
    """Start fastft in this worker: reads what ``fastft run`` put in the environment (or
    ``config``), connects to the job's store and joins its error bus. Then call
    :meth:`Runtime.register` with the model and optimizer."""
    if os.environ.get(SPARE_RUN_AHEAD):  # a warm spare that ran the script ahead:
        await_order()  # it becomes its worker here
    if config is None:
        config = RuntimeConfig.from_env(**overrides)
    return Runtime(config)
