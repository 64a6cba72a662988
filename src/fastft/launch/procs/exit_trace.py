"""Seeing a worker's death at its start, not after its memory is freed.

The kernel reports a child's exit to ``waitid`` only once the child's address space is
torn down (``exit_mm`` runs before ``exit_notify``): ~15 ms after a SIGKILL for a bare
``import torch``, ~30-50 ms for a worker holding a few hundred MB (``python
bench/kill_teardown.py``). A thread traced with ``PTRACE_O_TRACEEXIT`` instead stops at the
start of its exit (``PTRACE_EVENT_EXIT``), before the memory goes, and its tracer is told
at once, even for SIGKILL. Each worker runs one idle, all-signals-blocked sentinel thread
(:mod:`fastft.process.sentinel`); the agent traces that thread alone, one tracer thread
per worker life (ptrace requests must come from the thread that attached):

* ``PTRACE_EVENT_EXIT``: report the exit (status from ``PTRACE_GETEVENTMSG``), then let
  the thread go on exiting (``PTRACE_CONT``) and wait for it, since a thread group leader
  is not reported to its parent while a traced thread of it is unreaped;
* a group stop (SIGSTOP): ``PTRACE_LISTEN``, so the stop stays a stop and SIGCONT still
  ends it, and report the stop. The parent's ``waitid(WSTOPPED)`` cannot be relied on
  then: when the tracer and the real parent are one process, the kernel notifies only
  the tracer if the traced thread is the last to stop (``ptrace_stop``: "notify
  separately unless they're gonna be duplicates"), and that wakes no waiter of the
  worker's pid;
* any other stop (a signal sent to the sentinel's thread id; its mask blocks the rest):
  the signal is passed on.

Nothing here is needed for correctness: where ptrace is refused (a seccomp profile,
``kernel.yama.ptrace_scope=3``), the agent logs it once and falls back to ``waitid``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ExitTracer", "OnExit", "decode_status"]

log = logging.getLogger(__name__)

PTRACE_CONT = 7
PTRACE_GETEVENTMSG = 0x4201
PTRACE_SEIZE = 0x4206
PTRACE_LISTEN = 0x4208
PTRACE_O_TRACEEXIT = 0x40
PTRACE_EVENT_EXIT = 6
PTRACE_EVENT_STOP = 128
_WALL = 0x40000000
_SLOW_AFTER_S = 30.0
_SLOW_POLL_S = 0.5
_GROUP_STOPS = {signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}

OnExit = Callable[[int | None, int | None, float], None]
"""``(exit code, signal, time.monotonic())`` of a worker's exit."""

_libc = ctypes.CDLL(None, use_errno=True)
_ptrace = _libc.ptrace
_ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_ptrace.restype = ctypes.c_long


def decode_status(status: int) -> tuple[int | None, int | None]:
    """(exit code, signal) from a wait status such as ``PTRACE_GETEVENTMSG`` gives at exit."""
    sig = status & 0x7F
    return (None, sig) if sig else ((status >> 8) & 0xFF, None)


@dataclass(frozen=True)
class _Watch:
    """One worker life to trace (see :meth:`ExitTracer.watch`)."""

    pid: int
    path: str
    alive: Callable[[], bool]
    report: OnExit
    after: OnExit
    stopped: Callable[[float], None]


class ExitTracer:
    """Traces the sentinels of one agent's workers.

    :meth:`watch` starts a thread for one worker life: it waits for the worker to write its
    sentinel's thread id to ``path``, attaches, and calls ``report(code, sig, t)`` the
    moment that thread starts to exit (``t``: ``time.monotonic()``), then, once the thread
    was let go, ``after(code, sig, t)``; ``stopped(t)`` when the worker is being stopped
    (SIGSTOP and the like). ``alive()`` says whether to keep waiting for the file. After the
    first refusal to attach, no more threads are started.
    """

    def __init__(self, poll_s: float = 0.02) -> None:
        self.poll_s = poll_s
        self.refused: str | None = None
        self.attached = 0

    def watch(
        self,
        pid: int,
        path: str,
        alive: Callable[[], bool],
        report: OnExit,
        after: OnExit,
        stopped: Callable[[float], None] = lambda t: None,
    ) -> threading.Thread | None:
        if self.refused is not None:
            return None
        t = threading.Thread(
            target=self._run,
            args=(_Watch(pid, path, alive, report, after, stopped),),
            name=f"fastft-exit-trace-{pid}",
            daemon=True,
        )
        t.start()
        return t

    def _run(self, w: _Watch) -> None:
        pid, report, after, stopped = w.pid, w.report, w.after, w.stopped
        tid = self._await_tid(pid, w.path, w.alive)
        if tid is None:
            return
        if _ptrace(PTRACE_SEIZE, tid, None, ctypes.c_void_p(PTRACE_O_TRACEEXIT)) != 0:
            err = ctypes.get_errno()
            if err == 3:  # ESRCH: the worker died meanwhile; waitid reports it
                return
            self.refused = os.strerror(err)
            log.warning(
                "agent: cannot trace worker %d's exits (ptrace: %s); deaths are seen when "
                "the kernel reports them, after the worker's memory is freed",
                pid,
                self.refused,
            )
            return
        self.attached += 1
        while True:
            try:
                _, status = os.waitpid(tid, _WALL)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if not os.WIFSTOPPED(status):
                return  # the thread is gone (exited after PTRACE_CONT, or never stopped)
            event, sig = status >> 16, os.WSTOPSIG(status)
            if event == PTRACE_EVENT_EXIT:
                now = time.monotonic()
                msg = ctypes.c_ulong()
                _ptrace(PTRACE_GETEVENTMSG, tid, None, ctypes.byref(msg))
                code, killed_by = decode_status(msg.value)
                try:
                    report(code, killed_by, now)
                except Exception:
                    log.exception("agent: reporting worker %d's exit failed", pid)
                finally:
                    _ptrace(PTRACE_CONT, tid, None, None)
                try:
                    after(code, killed_by, now)
                except Exception:
                    log.exception("agent: handling worker %d's exit failed", pid)
            elif event == PTRACE_EVENT_STOP:
                if sig in _GROUP_STOPS:
                    _ptrace(PTRACE_LISTEN, tid, None, None)
                    try:
                        stopped(time.monotonic())
                    except Exception:
                        log.exception("agent: handling worker %d's stop failed", pid)
                else:
                    _ptrace(PTRACE_CONT, tid, None, None)
            else:  # a signal for this thread: deliver it
                _ptrace(PTRACE_CONT, tid, None, ctypes.c_void_p(sig))

    def _await_tid(self, pid: int, path: str, alive: Callable[[], bool]) -> int | None:
        """The sentinel's thread id, once the worker wrote it. A worker that does not
        start one (not a fastft script) is looked at less often after a while."""
        started = time.monotonic()
        while alive():
            try:
                with open(path) as f:
                    tid = int(f.read())
            except (OSError, ValueError):
                late = time.monotonic() - started > _SLOW_AFTER_S
                time.sleep(max(self.poll_s, _SLOW_POLL_S) if late else self.poll_s)
                continue
            try:
                os.unlink(path)
            except OSError:
                pass
            if os.path.exists(f"/proc/{pid}/task/{tid}"):
                return tid
            log.warning("agent: worker %d named thread %d, which is not one of its own", pid, tid)
            return None
        return None
