"""Ending a process that abandoned process groups, and dropping groups off the hot path."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

__all__ = ["drop_later", "exit_without_destructors_later"]


def drop_later(groups: list[Any]) -> None:
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
