"""In-process restart: :meth:`fastft.Runtime.run` (issue 23, after NVRx's in-process
``Wrapper``).

An exception inside a transaction rolls the step back and the step runs again; one that
escapes every transaction (data loading between steps, an evaluation, a checkpoint hook,
a step that failed ``max_step_retries`` times) would end the process, and a restart
would cost a new Python, its imports and a heal. Under ``ft.run(train)`` it restarts
``train`` in the same process instead:

1. ``on_fault(exc)`` runs;
2. the health checks run (:mod:`fastft.runtime.health`); a worker that fails them is not
   admitted again: it ends (``EXIT_UNHEALTHY``) and its agent gives the slot to a spare,
   lets the world shrink, or stops the job;
3. the worker leaves its epoch and rejoins it: it reports a fault of its own (the step its
   peers run without it rolls back, nothing committed is lost). With ``heal="auto"`` and
   live peers its state is *suspect*: it heals from a peer whose state is not, and when
   every survivor is suspect (an evaluation that raised on every rank) the lowest one's
   serves the others; a state that holds NaN or Inf is lost (a Fault1: it heals from a
   peer as a restarted worker would, or the durable tier restores it). ``heal=True``:
   always a Fault1; ``heal=False``: never heal;
4. ``before_restart()`` runs, then ``train`` is called again, at the committed step;
5. ``finalize()`` runs once, when ``train`` returns or the wrapper gives up.

More than ``max_restarts`` in-process restarts within ``window_s`` end the process with
the exception (its agent restarts it, and counts the fault). Every in-process restart is
also a fault of the worker's slot for the agent's repeat-offender count
(:mod:`fastft.launch.rules.offenders`).

**Timeouts.** A watchdog thread watches the worker's progress (its heartbeat: every step,
and every wait of the runtime's). No progress for ``soft_timeout_s`` after the first
commit: it prints every thread's stack and raises :class:`SoftTimeout` in the main thread
(outside the runtime's own machinery), which restarts ``train`` in process. No progress
for ``hard_timeout_s``: it kills the process (its agent restarts it). Defaults, from the
agent's own limit for a step (:func:`fastft.process.heartbeat.hang_limit`: 10x the
worker's pace, at least 0.5 s, at most ``--hang-timeout``): soft = half of it, hard = 90 %
of it (the agent's kill comes last). Between steps (an evaluation, a checkpoint) the
defaults are half and 90 % of the agent's ``--between-steps-timeout`` (1800 s) instead:
long work there is not a hang.
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastft.errors import FastFTError
from fastft.fsm import Phase
from fastft.inject import StateLostFault
from fastft.process.beat import hang_limit
from fastft.process.sched import KeptOff
from fastft.runtime.endings import ScriptError, WorkerExit, misuse
from fastft.runtime.health import admit_or_leave, state_damage

if TYPE_CHECKING:
    from fastft.runtime.ports import RuntimePorts

__all__ = ["Restartable", "SoftTimeout", "timeouts"]

log = logging.getLogger(__name__)

T = TypeVar("T")

WINDOW_S = 600.0


class SoftTimeout(FastFTError, RuntimeError):
    """Raised in the main thread when the worker made no progress for the soft timeout."""


def timeouts(limit_s: float, soft_s: float | None, hard_s: float | None) -> tuple[float, float]:
    """(soft, hard) in seconds: the given ones, else half and 90 % of the agent's
    ``limit_s`` (see the module); the hard one never before the soft one."""
    soft = soft_s if soft_s is not None else limit_s / 2
    hard = hard_s if hard_s is not None else 0.9 * limit_s
    return soft, max(hard, soft)


@dataclass
class Restartable:
    """One ``ft.run(fn, ...)`` (see the module); :meth:`__call__` runs it."""

    rt: RuntimePorts
    fn: Callable[..., Any]
    on_fault: Callable[[BaseException], Any] | None = None
    health_check: Callable[[], Any] | None = None
    before_restart: Callable[[], Any] | None = None
    finalize: Callable[[], Any] | None = None
    max_restarts: int = 3
    window_s: float = WINDOW_S
    heal: bool | str = "auto"
    soft_timeout_s: float | None = None
    hard_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.heal not in ("auto", True, False):
            raise ValueError(f"heal={self.heal!r}: use 'auto', True or False")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("max_restarts must be >= 0 and window_s > 0")
        self._times: collections.deque[float] = collections.deque()
        self.restarts = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rt = self.rt
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ft.run() must be called from the main thread")
        if not rt.registered:
            raise RuntimeError("call ft.register(model=..., optimizer=...) before ft.run()")
        dog = _Watchdog(rt, self.soft_timeout_s, self.hard_timeout_s)
        dog.start()
        try:
            while True:
                try:
                    return self.fn(*args, **kwargs)
                except WorkerExit:
                    raise  # the runtime is ending this worker
                except Exception as e:
                    why = misuse(e)
                    if why is not None:  # a restart would fail the same way
                        log.critical("%s", why)
                        raise ScriptError(why) from e
                    rt.interrupter.raise_in_main(None)
                    self._restart(e)
        finally:
            dog.stop()
            if self.finalize is not None:
                self.finalize()

    def _restart(self, e: Exception) -> None:
        rt, x = self.rt, self.rt.engine
        now = time.monotonic()
        self._times.append(now)
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()
        cause = f"{type(e).__name__}: {e}"[:300]
        log.error("rank %d: %s escaped the step; restarting in process", rt.rank, cause, exc_info=e)
        if self.on_fault is not None:
            self.on_fault(e)
        if len(self._times) > self.max_restarts:
            rt.events.emit("restart_given_up", step=rt.step, cause=cause, restarts=self.restarts)
            raise e
        t0 = time.monotonic()
        view = x.seen().view
        peers = view is not None and len(view.members) > 1
        lose = self.heal is True
        suspect = self.heal == "auto" and peers
        if suspect and state_damage(rt.registry) is not None:  # damaged for sure: a Fault1
            lose, suspect = True, False
        extra = [("user", self.health_check)] if self.health_check is not None else []
        admit_or_leave(rt, check_state=not lose, extra=extra)  # (raises Unhealthy)
        step = rt.step
        # Leave and rejoin: the peers roll their step back and re-form. A Fault1 heals; a
        # suspect state heals from a peer whose state is not suspect, and is the source
        # when there is none (every rank raised in the same evaluation: their states are
        # the committed one, which no member would hold if each declared it lost).
        x.suspect(suspect)
        x.local_fault(StateLostFault(f"in-process restart ({cause})") if lose else e)
        rt.drive(lambda s: s.phase is Phase.NORMAL)
        if self.before_restart is not None:
            self.before_restart()
        self.restarts += 1
        rt.events.emit(
            "restarted_in_process",
            step=rt.step,
            fault_step=step,
            healed=lose or suspect,
            cause=cause,
            restart_ms=round((time.monotonic() - t0) * 1e3, 3),
            restarts=self.restarts,
        )


class _Watchdog:
    """The soft and hard timeouts (see the module)."""

    def __init__(self, rt: RuntimePorts, soft_s: float | None, hard_s: float | None) -> None:
        self.rt = rt
        self.soft_s, self.hard_s = soft_s, hard_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastft-watchdog", daemon=True)
        self._soft_at: float | None = None
        """The beat the soft timeout fired for (once per stall)."""
        self._kept = KeptOff(os.getpid())
        """How long the machine kept this process off the CPU in a stall (paced limits
        count only the rest: :func:`fastft.launch.rules.policy.hang_verdict`)."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self.rt.interrupter.raise_in_main(None)

    def _run(self) -> None:
        rt, hb = self.rt, self.rt.heartbeat
        while not self._stop.wait(0.2):
            if not hb.tracking or rt.engine.closing:
                continue  # before the first commit: the agent's start-up grace applies
            cfg = rt.config
            if hb.between_since:  # between steps: an evaluation, a checkpoint (see the module)
                limit = cfg.between_steps_timeout_s
            else:
                limit = hang_limit(hb.pace, cfg.hang_timeout_s, by_pace=cfg.hang_pace)
            soft, hard = timeouts(limit, self.soft_s, self.hard_s)
            last = hb.last
            now = time.monotonic()
            idle = own = now - last
            if not hb.between_since and limit < cfg.hang_timeout_s:  # (paced)
                own = idle * (1.0 - self._kept.share(last, idle, soft, now))
                if idle > 0.9 * cfg.hang_timeout_s:
                    own = idle  # (never past the agent's own --hang-timeout)
            if own > hard:
                self._hard(idle, hard)
                return
            if own > soft:
                if self._soft_at != last:
                    self._soft_at = last
                    self._soft(idle, soft)
                else:  # not raised yet (the main thread was in the runtime's machinery)
                    rt.interrupter.raise_in_main(rt.interrupter.forced)
            elif idle <= soft:  # (the stall ended)
                self._soft_at = None

    def _soft(self, idle: float, soft: float) -> None:
        rt = self.rt
        rt.events.emit(
            "soft_timeout", step=rt.step, idle_s=round(idle, 3), timeout_s=round(soft, 3)
        )
        log.error("rank %d: no progress for %.1f s (soft timeout): stacks follow", rt.rank, idle)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        rt.interrupter.raise_in_main(
            SoftTimeout(f"no progress for {idle:.1f} s (soft timeout {soft:.1f} s)")
        )

    def _hard(self, idle: float, hard: float) -> None:
        rt = self.rt
        rt.events.emit(
            "hard_timeout", step=rt.step, idle_s=round(idle, 3), timeout_s=round(hard, 3)
        )
        log.error(
            "rank %d: no progress for %.1f s (hard timeout): killing the process", rt.rank, idle
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        rt.events.close()
        os.kill(os.getpid(), signal.SIGKILL)
