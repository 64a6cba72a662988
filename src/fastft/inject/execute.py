"""Executing faults of the catalogue inside the target process.

:class:`Injector` holds a rank's share of the :class:`FaultPlan` and the live injections
that arrive on the bus (``Inject`` messages from ``fastft inject``). Process-level kinds
(signals, segfault, exit, GIL hang) execute at once in whichever thread sees them (a bus
listener, for live injection); exception-like kinds (``exception``, ``state_lost``) must be
raised in the main thread, inside the step, so they are queued and raised by
:meth:`Injector.fire_due`, which the training loop calls at the start of each step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from fastft.errors import FastFTError
from fastft.inject.plan import FaultKind, FaultPlan, FaultSpec
from fastft.protocol.messages import NO_STEP, Inject, Message

__all__ = ["InjectedFault", "StateLostFault", "Injector", "execute"]

log = logging.getLogger(__name__)


class InjectedFault(FastFTError, RuntimeError):
    """The ``exception`` fault: a transient error in the step (Fault2)."""


class StateLostFault(FastFTError, RuntimeError):
    """The ``state_lost`` fault: this worker's state must be healed from a peer (Fault1)."""


_IN_MAIN = (FaultKind.EXCEPTION, FaultKind.STATE_LOST, FaultKind.SLOW, FaultKind.BITFLIP)


def execute(spec: FaultSpec) -> None:
    """Perform ``spec`` in this process now. Most kinds do not return."""
    when = "now (live)" if spec.at_step is None else f"at step {spec.at_step}"
    log.warning("injecting fault %s (rank %d, %s)", spec.kind.value, spec.rank, when)
    k = spec.kind
    if k is FaultKind.EXCEPTION:
        raise InjectedFault(f"injected exception {when}")
    if k is FaultKind.STATE_LOST:
        raise StateLostFault(f"injected state loss {when}")
    if k is FaultKind.SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif k is FaultKind.SIGTERM:
        os.kill(os.getpid(), signal.SIGTERM)
    elif k is FaultKind.SIGSTOP:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif k is FaultKind.SEGFAULT:
        ctypes.string_at(0)
    elif k is FaultKind.EXIT:
        os._exit(int(spec.arg) or 1)
    # (SLOW: the injector stretches the steps that follow: Injector.fire_due; BITFLIP:
    # the runtime flips the bit in the state it holds: engine.faults)
    elif k is FaultKind.GIL_HANG:
        # A PyDLL call keeps the GIL: no thread of this process runs Python meanwhile.
        seconds = int(spec.arg) if spec.arg > 0 else 10**6
        ctypes.PyDLL(None).sleep(ctypes.c_uint(seconds))


class Injector:
    """One rank's injector. ``on_message`` is a bus callback; ``fire_due`` runs in the
    main thread at the start of every step."""

    def __init__(
        self,
        plan: FaultPlan,
        rank: int,
        life: int = 0,
        *,
        executor: Callable[[FaultSpec], None] = execute,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rank = rank
        self.life = life
        self._executor = executor
        self._pause = pause
        """A fault's ``delay_s`` at its point: the worker alive meanwhile (its heartbeat
        beats: a delay is not a hang)."""
        self._lock = threading.Lock()
        self._scheduled = list(plan.for_rank(rank, life))
        self._queued: list[FaultSpec] = []
        self.fired: list[tuple[FaultSpec, int]] = []
        self._slow: tuple[float, int] | None = None
        """An active ``slow`` fault: (factor, last step; -1: the life's end)."""
        self._step_began: float | None = None

    def on_message(self, msg: Message) -> None:
        if not isinstance(msg, Inject) or msg.target_rank != self.rank:
            return
        try:
            spec = FaultSpec(
                kind=FaultKind(msg.fault_kind),
                rank=msg.target_rank,
                at_step=None if msg.at_step == NO_STEP else msg.at_step,
                life=self.life,
                arg=msg.arg,
            )
        except (ValueError, FastFTError) as e:
            log.warning("ignoring inject request from rank %d: %s", msg.rank, e)
            return
        if spec.at_step is None and spec.kind not in _IN_MAIN:
            self.fired.append((spec, NO_STEP))
            self._executor(spec)
            return
        with self._lock:
            (self._scheduled if spec.at_step is not None else self._queued).append(spec)

    def fire_due(self, step: int, point: str = "step") -> None:
        """Fire every fault due at ``step`` and ``point`` (at ``step``, also live ones
        queued for the main thread)."""
        with self._lock:
            due = [
                s
                for s in self._scheduled
                if s.point == point and s.at_step is not None and s.at_step <= step
            ]
            self._scheduled = [s for s in self._scheduled if s not in due]
            if point == "step":
                due = self._queued + due
                self._queued = []
        for spec in due:
            self.fired.append((spec, step))
            if spec.delay_s:
                self._pause(spec.delay_s)
            if spec.kind is FaultKind.SLOW:  # (a gray failure: it lasts, from this step)
                self._slow = (spec.arg, step + spec.steps - 1 if spec.steps else -1)
            self._executor(spec)
        self._drag(step, point)

    def _drag(self, step: int, point: str) -> None:
        """A ``slow`` fault's effect: the step's compute so far (from its start to its
        gradient collective) takes ``factor`` times as long."""
        slow = self._slow
        if slow is None:
            return
        factor, last = slow
        if last != -1 and step > last:
            self._slow = None
        elif point == "step":
            self._step_began = time.monotonic()
        elif point == "collective" and self._step_began is not None:
            time.sleep((factor - 1) * (time.monotonic() - self._step_began))
            self._step_began = None

    @property
    def pending(self) -> tuple[FaultSpec, ...]:
        with self._lock:
            return tuple(self._scheduled + self._queued)
