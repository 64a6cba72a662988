"""Delivering a peer's fault to a rank's main thread, wherever it is blocked.

Measured with torch 2.13 on CPU (DESIGN "Interrupting a blocked rank"): a raising signal
handler interrupts sleeps and socket waits in ~0.2 ms but never a
``torch.futures.Future.wait()``; ``Future.set_exception`` wakes such a waiter in ~0.15 ms;
Gloo's ``abort()`` does not release an allreduce whose peer is hung, while waiting on the
work's future (which we can fail) does. So :meth:`Interrupter.interrupt`, called from the
bus listener thread, in this order:

1. marks the step aborted (interruptible collectives refuse to start and fail fast);
2. sets :class:`FutureCancelled` on every registered pending future;
3. runs the registered abort hooks (e.g. NCCL communicator abort);
4. sends a signal to the main thread, whose handler raises :class:`StepInterrupted` --
   unless the main thread is inside :meth:`atomic`, where the raise is deferred to the end
   of the section.

The raise happens exactly once per step whichever path gets there first: each step has one
*token* (a ``threading.Lock``); a path raises only if its non-blocking ``acquire`` wins,
which is atomic even against a signal handler running between two bytecodes of the same
thread. State shared with the listener thread is guarded by one lock.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch

from fastft.interrupt.contract import FutureCancelled, StepInterrupted
from fastft.protocol.messages import Message

__all__ = ["Interrupter", "DEFAULT_SIGNAL"]

log = logging.getLogger(__name__)

DEFAULT_SIGNAL = signal.SIGUSR1


class Interrupter:
    """Interrupts the main thread's current step. One per process.

    Use from the main thread: :meth:`install` (signal handler), then per step
    :meth:`begin_step`; blocking waits register their futures with :meth:`pending`;
    code that must not be torn (an optimizer update, a state copy) runs in :meth:`atomic`.
    Any thread may call :meth:`interrupt`.
    """

    def __init__(self, signum: int = DEFAULT_SIGNAL) -> None:
        self.signum = signum
        self._lock = threading.Lock()
        self._main_ident: int | None = None
        self._prev_handler: Any = None
        self._installed = False
        self._epoch = 0
        self._step = 0
        self._exc: StepInterrupted | None = None
        self._token = threading.Lock()
        self._futures: set[torch.futures.Future[Any]] = set()
        self._hooks: list[Callable[[], None]] = []
        self._atomic_depth = 0
        self.defer_s = 0.0
        """Main thread: for this many seconds after an interrupt, it does not raise in
        Python code (the step stays aborted; the next ``check()``, interruptible wait or
        ``atomic()`` end raises); then the main thread is signalled again. 0: raise at
        once. Reset by :meth:`begin_step`."""
        self._interrupted_at = 0.0
        self._deferral: threading.Timer | None = None
        self._armed = True  # step 0 of epoch 0 is armed until the first end_step()
        self._shielded: set[Any] = set()
        self._forced: BaseException | None = None
        self.interrupts = 0
        self.deliveries = 0

    # --- lifecycle (main thread) -----------------------------------------------------------
    def install(self) -> Interrupter:
        """Install the signal handler; must be called from the main thread."""
        if self._installed:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Interrupter.install() must run in the main thread")
        self._main_ident = threading.main_thread().ident
        self._prev_handler = signal.signal(self.signum, self._on_signal)
        self._installed = True
        return self

    def close(self) -> None:
        """Restore the previous signal handler. Idempotent."""
        self._cancel_deferral()
        with self._lock:
            if not self._installed:
                return
            self._installed = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._prev_handler or signal.SIG_DFL)

    def __enter__(self) -> Interrupter:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin_step(self, epoch: int, step: int) -> None:
        """Arm for a new step: forget the previous step's interrupt and futures."""
        self._cancel_deferral()
        with self._lock:
            self._epoch, self._step = epoch, step
            self._exc = None
            self._token = threading.Lock()
            self._futures.clear()
            self._armed = True
            self.defer_s = 0.0

    def defer(self, seconds: float) -> None:
        """This step's interrupts raise ``seconds`` after they come at the earliest
        (:attr:`defer_s`; 0: at once); ``begin_step`` resets it."""
        self.defer_s = seconds

    def end_step(self) -> None:
        """Disarm: the step's outcome is being decided; later interrupts are ignored (the
        runtime learns of the fault through its state machine instead)."""
        self._cancel_deferral()
        with self._lock:
            self._armed = False

    @property
    def armed(self) -> bool:
        return self._armed

    def shield(self, *functions: Callable[..., Any]) -> None:
        """Never raise from the signal handler while one of ``functions`` is on the main
        thread's stack (the runtime's own step machinery: raising inside a context
        manager's ``__enter__``/``__exit__`` would escape the ``with`` statement). The
        step stays marked aborted; the shielded code checks it at its own safe points."""
        for fn in functions:
            code = getattr(getattr(fn, "__func__", fn), "__code__", None)
            if code is None:
                raise TypeError(f"cannot shield {fn!r}: not a Python function")
            self._shielded.add(code)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        return self._step

    @property
    def aborted(self) -> bool:
        """True once the current step was interrupted."""
        return self._exc is not None

    @property
    def exception(self) -> StepInterrupted | None:
        return self._exc

    # --- registration ----------------------------------------------------------------------
    @contextlib.contextmanager
    def pending(self, fut: torch.futures.Future[Any]) -> Iterator[torch.futures.Future[Any]]:
        """Register ``fut`` for the duration of a wait: an interrupt fails it."""
        with self._lock:
            exc = self._exc
            if exc is None:
                self._futures.add(fut)
        if exc is not None:
            _fail(fut, exc)
        try:
            yield fut
        finally:
            with self._lock:
                self._futures.discard(fut)

    def add_abort_hook(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run ``hook()`` (in the interrupting thread) on every interrupt; returns a remover."""
        with self._lock:
            self._hooks.append(hook)

        def remove() -> None:
            with self._lock:
                if hook in self._hooks:
                    self._hooks.remove(hook)

        return remove

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section the interrupt may not tear; a pending interrupt is raised at its end."""
        self._atomic_depth += 1
        try:
            yield
        finally:
            self._atomic_depth -= 1
        if self._atomic_depth == 0:
            self.raise_if_interrupted()

    @property
    def in_atomic(self) -> bool:
        return self._atomic_depth > 0

    # --- delivery --------------------------------------------------------------------------
    def interrupt(
        self,
        reason: str,
        *,
        message: Message | None = None,
        epoch: int | None = None,
        step: int | None = None,
    ) -> bool:
        """Interrupt the current step (any thread). ``epoch``/``step``, when given, must
        match the armed step, else the call is stale and ignored. Returns True if this call
        interrupted the step, False if it was already interrupted or stale.

        Called from the main thread itself, nothing is raised here: the step is marked
        aborted and the next ``check()``, interruptible wait or end of ``atomic()`` raises."""
        with self._lock:
            if epoch is not None and epoch != self._epoch:
                return False
            if step is not None and step != self._step:
                return False
            if not self._armed or self._exc is not None:
                return False
            exc = StepInterrupted(reason, epoch=self._epoch, step=self._step, message=message)
            self._exc = exc
            self._interrupted_at = time.monotonic()
            defer = self.defer_s
            futures = list(self._futures)
            hooks = list(self._hooks)
            self.interrupts += 1
        for fut in futures:
            _fail(fut, exc)
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("abort hook %r failed", hook)
        if self._installed and threading.get_ident() != self._main_ident:
            self._poke_main()
            if defer > 0:  # the deferral ends even if the main thread never checks
                t = threading.Timer(defer, self._poke_if, (exc,))
                t.daemon = True
                t.name = "fastft-interrupt-deferral"
                with self._lock:
                    self._deferral = t
                t.start()
        return True

    @property
    def forced(self) -> BaseException | None:
        """The exception :meth:`raise_in_main` was last told to raise, not raised yet."""
        return self._forced

    def raise_in_main(self, exc: BaseException | None) -> None:
        """Raise ``exc`` in the main thread at its next Python instruction outside
        :meth:`atomic` and the shielded machinery, inside a step or not (any thread; a
        soft timeout). Call it again to re-signal a main thread that was shielded; None
        withdraws it."""
        with self._lock:
            self._forced = exc
            if exc is None or not self._installed:
                return
        self._poke_main()

    def _cancel_deferral(self) -> None:
        if self._deferral is None:  # the fault-free path: twice per step, no lock
            return
        with self._lock:
            t, self._deferral = self._deferral, None
        if t is not None:
            t.cancel()

    def _poke_if(self, exc: StepInterrupted) -> None:
        with self._lock:  # close() uninstalls under the lock: never a signal without handler
            if self._installed and self._exc is exc and self._armed:
                self._poke_main()

    def raise_if_interrupted(self) -> None:
        """Raise StepInterrupted if the step was interrupted and nobody raised it yet.

        Main thread only; used by waits that were woken and by the end of ``atomic()``."""
        exc = self._exc
        if exc is not None and self._token.acquire(blocking=False):
            self.deliveries += 1
            raise exc

    def check(self) -> None:
        """Raise StepInterrupted if the current step is aborted (even if raised before): a
        dead step must not start new collectives."""
        exc = self._exc
        if exc is not None:
            self._token.acquire(blocking=False)
            raise exc

    def _poke_main(self) -> None:
        assert self._main_ident is not None
        signal.pthread_kill(self._main_ident, self.signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        forced = self._forced
        if forced is not None and self._atomic_depth == 0 and not self._in_shield(frame):
            self._forced = None
            raise forced
        if self._exc is None or self._atomic_depth > 0 or not self._armed:
            return  # stale signal, or deferred to the end of atomic()
        if self.defer_s and time.monotonic() - self._interrupted_at < self.defer_s:
            return  # deferred to the next check(), or to the deferral's end
        if self._in_shield(frame):
            return
        self.raise_if_interrupted()

    def _in_shield(self, frame: FrameType | None) -> bool:
        f = frame
        while f is not None and self._shielded:
            if f.f_code in self._shielded:
                return True
            f = f.f_back
        return False


def _fail(fut: torch.futures.Future[Any], exc: StepInterrupted) -> None:
    try:
        if not fut.done():
            fut.set_exception(FutureCancelled(str(exc)))
    except RuntimeError:  # completed concurrently
        pass
