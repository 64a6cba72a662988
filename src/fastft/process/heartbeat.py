"""The heartbeat file: a worker's progress, read by its agent's hang detector.

The writer (:class:`HeartbeatWriter`) lives in the worker (the native runtime or ``ManagerFFT``);
the reader (:func:`read_heartbeat`) in the agent. One small shared file per worker:
CLOCK_MONOTONIC of the last sign of life, the longest recent gap between beats, and since
when the worker is between steps (0 inside one).
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import threading
import time

__all__ = ["STACKS_SIGNAL", "HeartbeatWriter", "dump_stacks_on_signal", "read_heartbeat"]

STACKS_SIGNAL = signal.SIGUSR2
"""What the agent sends a worker it found hung, just before it kills it: the worker's
``faulthandler`` prints every thread's Python stack to stderr from its C handler, which
works while a thread holds the GIL. Not SIGUSR1: that is the interrupter's signal, whose
Python-level handler replaces faulthandler's and never runs in a GIL-holding hang."""


def dump_stacks_on_signal() -> None:
    """Print every thread's stack on :data:`STACKS_SIGNAL` (main thread only: elsewhere
    Python cannot install signal handlers, and nothing is done)."""
    if threading.current_thread() is threading.main_thread():
        faulthandler.register(STACKS_SIGNAL, all_threads=True)


class _Blocked:
    """``with hb.blocked:`` the main thread is blocked in an interruptible wait: the
    heartbeat thread keeps beating for it (the agent must not take a waiting worker for a
    hung one). One reusable object per heartbeat."""

    def __init__(self, hb: HeartbeatWriter) -> None:
        self.hb = hb

    def __enter__(self) -> None:
        self.hb.waiting(True)

    def __exit__(self, *exc: object) -> None:
        self.hb.waiting(False)


_FMT = "<ddd"
"""The heartbeat file: last beat, longest recent gap, between-steps since (24 bytes)."""


class HeartbeatWriter:
    """Progress for the agent's hang detector, in a small shared file: CLOCK_MONOTONIC of
    the last sign of life, and the longest gap between beats seen lately (0 until the first
    commit), which an agent with ``--adaptive-hang`` scales into its timeout. The main
    thread beats at every step boundary and wait loop; while it is blocked in an
    interruptible wait a helper thread beats for it. A main thread that holds the GIL or
    loops without returning stops the beats."""

    _FMT = _FMT
    _DECAY = 0.999  # per beat: the longest gap fades over a few thousand beats

    def __init__(self, path: str | None) -> None:
        self._mm: mmap.mmap | None = None
        self._waiting = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prev = 0.0
        self._last = time.monotonic()
        self._gap = 0.0
        self._between = 0.0
        self.tracking = False
        """Set after the first commit: gaps before it (start-up, healing) are not steps."""
        self.blocked = _Blocked(self)
        if path:
            size = struct.calcsize(self._FMT)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
            os.close(fd)
            self.beat()
            self._thread = threading.Thread(target=self._run, name="fastft-heartbeat", daemon=True)
            self._thread.start()

    @property
    def last(self) -> float:
        """CLOCK_MONOTONIC of the last sign of life (now, while in a blocked wait)."""
        return time.monotonic() if self._waiting.is_set() else self._last

    @property
    def gap(self) -> float:
        """The longest recent gap between beats (0 before the first commit)."""
        return self._gap

    @property
    def between_since(self) -> float:
        """Since when the main thread is between steps (0: inside one, or in the runtime)."""
        return self._between

    def beat(self) -> None:
        """The main thread's sign of progress."""
        now = time.monotonic()
        self._last = now
        self._write(now)

    def _write(self, now: float) -> None:
        if self._mm is None:
            return
        if self.tracking and self._prev:
            self._gap = max(now - self._prev, self._gap * self._DECAY)
        self._prev = now
        self._mm[0:24] = struct.pack(self._FMT, now, self._gap, self._between)

    def waiting(self, on: bool) -> None:
        (self._waiting.set if on else self._waiting.clear)()
        self.beat()

    def between(self, on: bool) -> None:
        """The main thread leaves a step for the user's code between steps (``on``), or
        enters the next. Between steps the helper thread beats while the interpreter runs:
        an evaluation or a checkpoint is not a hang; the agent judges that time by
        ``--between-steps-timeout`` instead of ``--hang-timeout``."""
        self._between = time.monotonic() if on else 0.0
        self.beat()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if self._waiting.is_set():
                self.beat()
            elif self._between:
                self._write(time.monotonic())  # alive, but no progress of the main thread

    EXIT_GRACE_S = 60.0
    """After close, the agent gives the process this long to exit before it calls it hung
    (interpreter teardown, torch's thread joins: seconds on a loaded machine, no beats)."""

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self._mm is not None:
            # A last beat in the future: the worker is leaving, not hung. The gap stays:
            # it tells the agent this life committed (zeroed, a worker that raised after
            # 100 commits was reported as failing "before its first commit").
            left = time.monotonic() + self.EXIT_GRACE_S
            self._mm[0:24] = struct.pack(self._FMT, left, self._gap, 0.0)
            self._mm.close()
            self._mm = None


def read_heartbeat(path: str) -> tuple[float, float, float] | None:
    """(last beat in CLOCK_MONOTONIC seconds, longest recent gap between beats (0 before
    the first commit), since when the worker is between steps (0: inside one)) from
    ``path``; None if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(24)
        return struct.unpack(_FMT, data) if len(data) == 24 else None
    except OSError:
        return None
