"""Abandoned process groups, and dropping groups off the hot path."""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "arm_fast_exit",
    "drop_later",
    "end_with",
    "exit_now",
    "join_at_exit",
    "keep_at_exit",
    "keep_forever",
    "write_ending",
]


JOIN_AT_EXIT_S = 10.0
"""How long the interpreter's exit waits, in all, for background threads inside torch."""
_joined: list[threading.Thread] = []
_joined_lock = threading.Lock()


_ending: list[tuple[int, str]] = []
_record: list[str] = []


def end_with(status: int, why: str = "") -> None:
    """The worker ends with ``status`` (a fastft ending: the job cannot go on, a drain, a
    fault storm, the job finished while it waited): see :func:`arm_fast_exit`."""
    _ending.append((status, why))


def arm_fast_exit(record: str | None = None) -> None:
    """At the interpreter's exit, once the atexit handlers registered after this call have
    run (the worker's own: bus, heartbeat, the durable writer), a worker that ends with a
    fastft ending (:func:`end_with`) writes its status and why to ``record`` (its agent
    trusts a fastft status only with it: :data:`fastft.protocol.exits.FASTFT_STATUSES`)
    and leaves with ``os._exit(status)``, skipping the interpreter's finalization: torch's
    teardown took 0.4-1 s here after ``import torch`` alone and 2.5 s in a worker on 2 busy
    cores, during which the agent waited for an exit that was already decided (issue 36).
    Other ends keep the normal exit."""
    if record is not None:
        _record[:] = [record]
    atexit.register(_fast_exit)


def exit_now(status: int, why: str) -> None:
    """End the process at once with a fastft status, its record written first."""
    write_ending(status, why)
    os._exit(status)


def write_ending(status: int, why: str) -> None:
    """The record beside a fastft status (see :func:`arm_fast_exit`); 0 needs none."""
    if not _record or status == 0:
        return
    try:
        tmp = f"{_record[0]}.tmp"
        with open(tmp, "w") as f:
            json.dump({"status": status, "why": why[:2000]}, f)
        os.replace(tmp, _record[0])
    except OSError as e:  # the agent then reads the status as the script's own
        print(f"fastft: could not record this worker's ending ({e})", file=sys.stderr)


def _fast_exit() -> None:
    if not _ending:
        return
    status, why = _ending[-1]
    write_ending(status, why)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: S110 - a closed stream: nothing left to flush
            pass
    os._exit(status)


def join_at_exit(t: threading.Thread) -> None:
    """Have the interpreter's exit wait (at most ``JOIN_AT_EXIT_S`` in all) for ``t``, a
    started daemon thread that calls into torch: a process that exits while such a thread
    is inside a C++ destructor aborts ("terminate called without an active exception")
    instead of ending with its own status."""
    with _joined_lock:
        _joined[:] = [x for x in _joined if x.is_alive()]
        if not _joined:
            atexit.unregister(_join_all)
            atexit.register(_join_all)
        _joined.append(t)


def _join_all() -> None:
    with _joined_lock:
        threads = list(_joined)
    deadline = time.monotonic() + JOIN_AT_EXIT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


_live: list[Callable[[], Iterable[Any]]] = []


def keep_at_exit(live: Callable[[], Iterable[Any]]) -> None:
    """At the interpreter's exit, keep forever what ``live()`` then returns (the process
    groups still in use): the interpreter's finalization would otherwise destroy them, and
    a Gloo group destroyed while a peer closes its end aborts the process
    (``gloo::IoException``, "Connection closed by peer", in ``std::terminate``) instead of
    ending with its status. The exit then skips C++'s static destructors too
    (:func:`keep_forever`)."""
    if not _live:
        atexit.register(_keep_live)
    _live.append(live)


def _keep_live() -> None:
    for live in _live:
        try:
            for obj in live():
                if obj is not None:
                    keep_forever(obj)
        except Exception:
            pass


def drop_later(groups: list[Any]) -> None:
    """Destroy process groups in a thread of their own: a Gloo group's destructor takes
    ~20 ms (its threads' shutdown), on whichever thread drops the last reference.
    ``groups`` must hold the only references: the caller gives them up. The process's
    exit waits for the thread (:func:`join_at_exit`)."""
    t = threading.Thread(target=groups.clear, name="fastft-pg-drop", daemon=True)
    t.start()
    join_at_exit(t)


def keep_forever(obj: Any) -> None:
    """Never destroy ``obj``: an abandoned process group (or one of its works) may still own
    an operation stuck on a dead peer, and its C++ destructor would abort the process
    (``std::terminate``) or wait for the peer. One reference is leaked on purpose, and the
    process then ends without C++'s static destructors, which would run while the group's
    threads still do (a segfault at exit): see :func:`_end_at_exit`. The exit status stays
    the one the program asked for."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _end_at_exit()


_armed = [False]
_status = [0]


def _end_at_exit() -> None:
    """Once: make the C library's ``exit(status)`` call ``_exit(status)`` first, after the
    interpreter has finalized (its buffers are flushed) and before C++'s static
    destructors. glibc's ``on_exit`` passes the status to its handler, so ``sys.exit(3)``
    ends with 3, an uncaught exception with 1 and a normal end with 0. Where there is no
    ``on_exit`` (not glibc), ``os._exit`` at interpreter exit, with status 1 after an
    uncaught exception and 0 otherwise (a ``sys.exit(n)`` status is lost there)."""
    if _armed[0]:
        return
    _armed[0] = True
    libc = ctypes.CDLL(None)
    on_exit = getattr(libc, "on_exit", None)
    if on_exit is not None:
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        handler = ctypes.cast(libc["_exit"], ctypes.c_void_p)  # (libc's _exit, the C function)
        # _exit(int) as a handler of (int status, void *arg): the status comes first
        on_exit(handler, None)
        # exit() runs its handlers newest first, and C++ registers a function-local
        # static's destructor when the static is first built (gloo's device loop, with
        # the first group: after this), so register again as the interpreter finalizes.
        atexit.register(on_exit, handler, None)
        return
    prev = sys.excepthook  # pragma: no cover - not glibc

    def hook(*args: Any) -> None:  # pragma: no cover
        _status[0] = 1
        prev(*args)

    sys.excepthook = hook  # pragma: no cover

    def leave() -> None:  # pragma: no cover
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[0])

    atexit.register(leave)  # pragma: no cover
