"""A warm spare's order: the agent hands a spare the environment and command line of the
worker it becomes (one JSON line on stdin). :func:`await_order` is where a spare that ran
the script ahead (``--spare-run-ahead``) waits: ``fastft.init()`` and ``ManagerFFT`` call it
first. The spare process itself is :mod:`fastft.launch.procs.spare`.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from fastft.process.env import READY_FD, SPARE_RUN_AHEAD

__all__ = ["await_order", "become", "ran_ahead", "tell_ready", "was_spare"]


def tell_ready() -> None:
    """Tell the agent this spare is warm (once; without a pipe, nothing)."""
    fd = os.environ.pop(READY_FD, None)
    if fd is None:
        return
    try:
        os.write(int(fd), b"r")
        os.close(int(fd))
    except (OSError, ValueError):
        pass  # an agent that is gone or did not ask: the order still comes on stdin


def become(line: bytes) -> list[str]:
    """Take the agent's order: the worker's environment (all of it), stdin like a fresh
    worker's; returns the worker's command line."""
    order = json.loads(line)
    _was_spare[0] = True
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a spare ignored it)
    os.environ.clear()
    os.environ.update(order["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the worker's stdin, like a fresh one
    return list(order["argv"])


_ran_ahead = [False]
_was_spare = [False]


def was_spare() -> bool:
    """Whether this worker is a warm spare that took its order (ran ahead or not)."""
    return _was_spare[0]


def ran_ahead() -> bool:
    """Whether this process is a warm spare that ran the script ahead and took its order."""
    return _ran_ahead[0]


def await_order() -> None:
    """In a spare that runs ahead: wait here for the agent's order and become the worker it
    names. ``fastft.init()`` and ``ManagerFFT`` call it first; anywhere else (a worker, a
    spare that took its order) it returns at once. A spare the agent no longer needs (its
    pipe closed) ends here, without running the rest of the script."""
    if SPARE_RUN_AHEAD not in os.environ:
        return
    tell_ready()  # the script's set-up before fastft.init() is done
    line = sys.stdin.buffer.readline()
    if not line:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    become(line)
    _ran_ahead[0] = True
