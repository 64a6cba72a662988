"""The process-group wrapper of ``ManagerFFT``: every collective's ``wait()`` waits on a
future of ours, which the collective's completion resolves *or* a bus fault fails (a Gloo
``abort()`` does not release an allreduce whose peer is stopped). The abandoned operation
keeps running on the old communicator, which torchft replaces at the next quorum; it is
kept alive (its destructor would block on the dead peer) and the process ends without
running destructors. On NCCL (or XCCL) the works are not wrapped: the communicator is
aborted instead, which NCCL supports. Chosen by the process group's backend, not by
whether CUDA is present (Gloo on a GPU machine is wrapped)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroup, ProcessGroupWrapper

from fastft.interrupt.collectives import relay
from fastft.process.teardown import keep_at_exit, keep_forever

__all__ = ["BusProcessGroup", "BusWork", "Pending", "aborts_release_waiters", "wrap"]

_SPIN_S = 50e-6
"""While a wrapped work is waited for: how long it is polled without sleeping."""
_POLL_S = 500e-6
"""... then the longest sleep between two polls (a bus fault wakes the sleep at once)."""


def wrap(pg: Any, pending: Pending) -> Any:
    """The group ``ManagerFFT`` gives torchft: a torchft ``ProcessGroup`` wrapped so that a
    bus fault ends its collectives' waits; a native ``torch.distributed`` group as it is
    (torchft checks and drives it itself; a bus fault then fails the step at the vote)."""
    return BusProcessGroup(pg, pending) if isinstance(pg, ProcessGroup) else pg


class Pending:
    """The in-flight collectives of the current communicator, and whether it is poisoned
    (a member is known dead: new collectives fail at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.futures: set[torch.futures.Future[Any]] = set()
        self.poisoned: Exception | None = None
        self.abandoned: list[Any] = []
        """Works abandoned in flight and the communicators they run on: never destroyed."""
        self.dirty = False
        """An operation was abandoned on the current communicator."""
        self.on_block: Callable[[bool], None] = lambda on: None

    def abandon(self, work: Any) -> None:
        """``work`` was left in flight: never destroyed, and its communicator is kept too
        when the next quorum replaces it."""
        self.abandoned.append(work)
        keep_forever(work)
        self.dirty = True

    def fail_all(self, exc: Exception) -> int:
        with self.lock:
            self.poisoned = exc
            futs, self.futures = self.futures, set()
        n = 0
        for f in futs:
            try:
                f.set_exception(exc)
                n += 1
            except RuntimeError:  # completed meanwhile
                pass
        return n


class BusWork(dist._Work):  # noqa: SLF001 - torch has no public Work to subclass
    """A collective whose ``wait()`` a bus fault can end.

    Its future completes when the work is waited for or polled (``wait``,
    ``is_completed``), as torchft's own works' callback chains are built at ``wait()``;
    no Python callback is attached to the Gloo work's future. A work abandoned on a dead
    peer fails later, perhaps while the interpreter finalizes, and torch then runs (or
    frees) such a callback on a Gloo thread that can no longer take the GIL: the thread
    exits through C++ frames and the process aborts ("terminate called after throwing an
    instance of 'gloo::IoException'") instead of ending with its status. Seen in 1 of 7
    runs of a torchft fault test, in the replica that ended last. ``get_future()`` before
    the work completed falls back to such a callback (a GPU machine's
    ``block_current_stream`` path)."""

    def __init__(self, work: dist._Work, pending: Pending) -> None:
        super().__init__()
        self._work = work
        self._pending = pending
        self._fut: torch.futures.Future[Any] = torch.futures.Future()
        self._relayed = False
        with pending.lock:
            poisoned = pending.poisoned
            if poisoned is None:
                pending.futures.add(self._fut)
        if poisoned is not None:
            self._fut.set_exception(poisoned)
            pending.abandon(work)

    def _forget(self) -> None:
        with self._pending.lock:
            self._pending.futures.discard(self._fut)

    def _settle(self) -> bool:
        """Whether the wait is over: the future is done (a bus fault failed it), or the
        work has completed; the future then takes the work's result if the work's own
        future has it (torchft's works may complete their futures later)."""
        if self._fut.done():
            return True
        if not self._work.is_completed():
            return False
        src = self._work.get_future()
        if src.done():
            self._forget()
            relay(self._fut, wrap=lambda e: e)(src)
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait until the collective completes, a bus fault fails it, or ``timeout``
        passes; then the work's own ``wait(timeout)`` gives its result (its errors, its
        timeout), as torchft's work would."""
        self._pending.on_block(True)
        try:
            self._await(timeout)
            if self._settle() and self._fut.done():
                self._fut.value()  # raises a bus fault, or the collective's own failure
            return bool(self._work.wait(timeout) if timeout is not None else self._work.wait())
        except Exception:
            self._pending.abandon(self._work)  # it may still run
            raise
        finally:
            self._pending.on_block(False)

    def _await(self, timeout: timedelta | None) -> None:
        """Poll the work (a spin of ``_SPIN_S``, then sleeps doubling up to ``_POLL_S``);
        a bus fault wakes the sleep at once."""
        if self._settle():
            return
        woken = threading.Event()
        self._fut.then(lambda _: woken.set())
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        t_spin = time.perf_counter() + _SPIN_S
        delay = 20e-6
        while not self._settle():
            if time.perf_counter() < t_spin:
                continue
            left = delay if deadline is None else min(delay, deadline - time.monotonic())
            if left <= 0:
                return  # the work's own wait(timeout) reports the timeout
            woken.wait(left)
            delay = min(delay * 2, _POLL_S)

    def is_completed(self) -> bool:
        self._settle()
        return self._fut.done()

    def get_future(self) -> torch.futures.Future[Any]:
        self._settle()
        if not self._fut.done() and not self._relayed:
            self._relayed = True
            fut = self._fut
            self._work.get_future().then(relay(fut, wrap=lambda e: e, first=self._forget))
        return self._fut

    def synchronize(self) -> None:
        pass

    def block_current_stream(self) -> None:
        pass


def aborts_release_waiters(pg: ProcessGroup) -> bool:
    """Whether aborting ``pg`` releases a collective stuck on a dead peer: NCCL's (and
    XCCL's) communicator abort does; Gloo's does not, so its works are wrapped instead.
    Decided by the backend, not by whether CUDA is present: Gloo runs on GPU machines too.
    A group that cannot name its backend yet (not configured) is wrapped."""
    try:
        name = pg.getBackendName()
    except Exception:  # NotImplementedError, or a native group's RuntimeError
        return False
    return "nccl" in name or "xccl" in name


class BusProcessGroup(ProcessGroupWrapper):
    """Wraps the user's torchft process group; collectives return :class:`BusWork`."""

    def __init__(self, pg: ProcessGroup, pending: Pending) -> None:
        super().__init__(pg=pg)
        self._inner = pg
        self._pending = pending
        self._wrap = not aborts_release_waiters(pg)
        # The communicator in use when the process ends is kept, not destroyed by the
        # interpreter's finalization, as the native runtime's are (see keep_at_exit).
        me = weakref.ref(self)
        keep_at_exit(lambda: (getattr(getattr(me(), "_inner", None), "_pg", None),))

    def _wrap_work(self, work: dist._Work, opts: object) -> dist._Work:
        return BusWork(work, self._pending) if self._wrap else work

    def reconfigure(self, opts: Any) -> Any:
        with self._pending.lock:
            self._pending.poisoned = None
        if self._pending.dirty:
            # The old communicator still runs an abandoned operation: keep it referenced
            # (torchft drops it now; its destructor would wait for the dead peer).
            keep_forever(self._inner.parent)
            self._pending.dirty = False
        return super().reconfigure(opts)

    def abort(self, errored: bool = True) -> None:
        if not self._wrap:  # NCCL: aborting the communicator releases its waiters
            self._inner.abort(errored)

    def errored(self) -> Exception | None:
        return self._inner.errored()

    @property
    def supports_reconfigure(self) -> bool:
        return bool(getattr(self._inner, "supports_reconfigure", False))

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> Any:
        return self._inner._create_pg(store, rank, world_size)  # noqa: SLF001 - torchft's own hook for building its inner group

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    def shutdown(self) -> None:
        self._inner.shutdown()
