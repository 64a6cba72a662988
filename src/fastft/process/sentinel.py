"""The exit sentinel: one idle thread per worker that lets the node agent see the worker's
death before the kernel has freed its memory.

A killed process is reported to its parent (``waitid``) only after its address space is
torn down: ~15 ms for a bare ``import torch`` and ~30-50 ms for a worker holding a few
hundred MB on this machine, all of it before anyone can react. The agent traces this one
thread (``PTRACE_SEIZE`` with ``PTRACE_O_TRACEEXIT``, :mod:`fastft.launch.procs.exit_trace`),
and a traced thread stops at the very start of its exit, before the memory goes: the
agent hears of a SIGKILL ~0.2 ms after it (``python bench/kill_teardown.py``).

The thread blocks every signal, so no signal meant for the process is ever delivered to
it (a traced thread would stop for each one and make the agent pass it on); it only
sleeps. Only this thread is traced, but a debugger or a blocking ``py-spy`` cannot attach
to a worker while its agent traces it; ``fastft run --no-exit-trace`` turns it off.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["start_exit_sentinel"]

_started: list[str] = []


def start_exit_sentinel(path: str | None) -> bool:
    """Start the sentinel and write its thread id to ``path`` (the agent's
    ``FASTFT_EXIT_TRACE_FILE``), once per process; False when there is nothing to do."""
    if not path or _started:
        return False
    _started.append(path)
    ready = threading.Event()

    def run() -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(threading.get_native_id()))
        os.replace(tmp, path)  # the agent never reads half a number
        ready.set()
        threading.Event().wait()  # forever: only its exit matters

    # Block every signal before the thread exists, so it inherits the mask: no signal
    # can reach it in the moment between its start and a mask of its own.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=run, name="fastft-exit-sentinel", daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    ready.wait(timeout=5)
    return True
