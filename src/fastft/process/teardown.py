"""Abandoned process groups, and dropping groups off the hot path."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from typing import Any

__all__ = ["drop_later", "keep_forever"]


def drop_later(groups: list[Any]) -> None:
    """Destroy process groups in a thread of their own: a Gloo group's destructor takes
    ~20 ms (its threads' shutdown), on whichever thread drops the last reference.
    ``groups`` must hold the only references: the caller gives them up."""
    threading.Thread(target=groups.clear, name="fastft-pg-drop", daemon=True).start()


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
        # _exit(int) as a handler of (int status, void *arg): the status comes first
        on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)
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
