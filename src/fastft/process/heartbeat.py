"""The heartbeat file: a worker's progress, read by its agent's hang detector.

The writer (:class:`HeartbeatWriter`) lives in the worker (the native runtime or ``ManagerFFT``);
the reader (:func:`fastft.process.beat.read_heartbeat`) in the agent. One small shared file per worker:
CLOCK_MONOTONIC of the last sign of life, the life's pace (how long its main thread is
silent in a step), since when the worker is between steps (0 inside one), and its commits.
"""

from __future__ import annotations

import collections
import faulthandler
import mmap
import os
import struct
import threading
import time

from fastft.process.beat import (
    BEAT_FORMAT,
    BEAT_SIZE,
    PACE_WINDOW,
    RECENT_STEPS,
    SETTLE_STEPS,
    STACKS_SIGNAL,
    Wait,
    compute_of,
    pace_of,
)

__all__ = ["HeartbeatWriter", "dump_stacks_on_signal"]


def dump_stacks_on_signal() -> None:
    """Print every thread's stack on :data:`STACKS_SIGNAL` (main thread only: elsewhere
    Python cannot install signal handlers, and nothing is done)."""
    if threading.current_thread() is threading.main_thread():
        faulthandler.register(STACKS_SIGNAL, all_threads=True)


class _Blocked:
    """``with hb.blocked:`` the main thread is blocked in an interruptible wait: the
    heartbeat thread keeps beating for it (the agent must not take a waiting worker for a
    hung one). One reusable object per heartbeat; :meth:`HeartbeatWriter.waiting_on` names
    the peer it waits on."""

    def __init__(self, hb: HeartbeatWriter, on: tuple[int, int] | None = None) -> None:
        self.hb = hb
        self.on = on

    def __enter__(self) -> None:
        self.hb.waiting(True, on_peer=self.on)

    def __exit__(self, *exc: object) -> None:
        self.hb.waiting(False)


class HeartbeatWriter:
    """Progress for the agent's hang detector, in a small shared file: CLOCK_MONOTONIC of
    the last sign of life, the life's *pace* and its commits. The main thread beats at every
    step boundary and wait loop; while it is blocked in an interruptible wait a helper
    thread beats for it. A main thread that holds the GIL or loops without returning stops
    the beats.

    The pace is what the agent scales into its hang timeout (:func:`fastft.launch.rules.policy.
    hang_verdict`): for each step the longest *silence* of the main thread (between two of
    its beats, not counting its waits: the step's compute, forward and backward), over the
    last :data:`PACE_WINDOW` steps that committed without a recovery (and not the life's
    first: it warms caches up), at the 99th percentile. Recoveries, heals and the time between steps are not silences: a hang
    verdict is relative to the job's own steps, not to its faults."""

    BEAT_FORMAT = BEAT_FORMAT

    def __init__(self, path: str | None) -> None:
        self._mm: mmap.mmap | None = None
        self._waiting = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = time.monotonic()
        self._silence = 0.0
        self._silences: collections.deque[float] = collections.deque(maxlen=PACE_WINDOW)
        self._pace = 0.0
        self._settled = True
        self._compute = 0.0
        self._walls: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._epoch = 0
        self._committed_at = 0.0
        self._step = 0.0
        self._wait_since = 0.0
        self._waits_on: tuple[int, int] | None = None
        self._outer: list[tuple[float, tuple[int, int] | None]] = []
        """The waits this one is nested in (:meth:`waiting`)."""
        self._unsettled = 0.0
        self._unsettled_left = 0
        self._commits = 0
        self._between = 0.0
        self.blocked = _Blocked(self)
        if path:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fd, BEAT_SIZE)
            self._mm = mmap.mmap(fd, BEAT_SIZE)
            os.close(fd)
            self.beat()
            self._thread = threading.Thread(target=self._run, name="fastft-heartbeat", daemon=True)
            self._thread.start()

    @property
    def last(self) -> float:
        """CLOCK_MONOTONIC of the last sign of life (now, while in a blocked wait)."""
        return time.monotonic() if self._waiting.is_set() else self._last

    @property
    def tracking(self) -> bool:
        """Whether this life committed a step (before, start-up and healing are not steps)."""
        return self._commits > 0

    @property
    def pace(self) -> float:
        """The life's pace (see the class; 0 before its first clean commit and while
        unsettled: :meth:`unsettle`)."""
        return self._pace if self._settled else 0.0

    @property
    def compute(self) -> float:
        """The life's recent compute per step (see :class:`Beat`)."""
        return self._compute

    @property
    def step(self) -> float:
        """The life's recent step time, commit to commit (see :class:`Beat`)."""
        return self._step

    @property
    def between_since(self) -> float:
        """Since when the main thread is between steps (0: inside one, or in the runtime)."""
        return self._between

    def beat(self) -> None:
        """The main thread's sign of progress."""
        now = time.monotonic()
        if not self._between and not self._waiting.is_set():
            self._silence = max(self._silence, now - self._last)
        self._last = now
        self._write(now)

    def committed(self, *, clean: bool) -> None:
        """The life committed a step; ``clean``: without a recovery since the last commit
        (its silences are the job's pace; a recovery's are not, nor those of a step after
        :meth:`unsettle`)."""
        self._commits += 1
        now = time.monotonic()
        if clean and self._settled and self._commits > 1 and self._silence > 0:
            self._silences.append(self._silence)  # (a life's first step warms up: not it)
            self._pace = pace_of(self._silences)
            self._recent.append(self._silence)
            self._compute = compute_of(self._recent)
            self._walls.append(now - self._committed_at)
            self._step = compute_of(self._walls)
        self._committed_at = now
        self._unsettled_left = max(0, self._unsettled_left - 1)
        self._settled = self._unsettled_left == 0
        self._unsettled = 0.0 if self._settled else now  # (each such step from its start)
        self._silence = 0.0
        self.beat()

    def new_world(self, epoch: int) -> None:
        """The worker adopted ``epoch``: its world (and its share of each batch) may have
        changed, so its compute and step time start again from that epoch's clean steps
        (0 until it has :data:`RECENT_STEPS`); a straggler judge compares a figure only
        with figures of the same epoch (a survivor computing a lost peer's share was named
        slow against the figure a cut node wrote before the cut). The pace is kept: a hang
        is still judged by it."""
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self._recent.clear()
        self._walls.clear()
        self._compute = self._step = 0.0
        self._write(time.monotonic())

    def unsettle(self) -> None:
        """A recovery or a new epoch: for :data:`SETTLE_STEPS` commits the steps may be
        unlike the job's pace (JAX compiles again for an elastic world's new shapes:
        seconds in a step of 30 ms, the re-run step's share of a batch then the new
        world's, two compiles; a collective builds new connections). Their silences are
        not the pace's; the helper thread beats while the interpreter runs (a compile lets
        it), so the agent still finds a GIL hang or a stopped process by the pace, and
        judges each step's length by ``--hang-timeout`` (from ``unsettled``). In the process
        (``ft.run``'s own watchdog, which cannot tell) the pace reads 0."""
        self._settled = False
        self._unsettled_left = SETTLE_STEPS
        self._unsettled = self._unsettled or time.monotonic()
        self._write(time.monotonic())

    def _write(self, now: float) -> None:
        if self._mm is not None:
            self._mm[0:BEAT_SIZE] = struct.pack(
                self.BEAT_FORMAT,
                now,
                self._pace,
                self._between,
                float(self._commits),
                self._compute,
                self._step,
                self._wait_since,
                self._unsettled,
                self._last,
                float(self._waits()),
                float(self._waits_on[0]) if self._waits_on else -1.0,
                float(self._epoch),
                self._waits_on[1] if self._waits_on else 0,
            )

    def _waits(self) -> Wait:
        if not self._wait_since:
            return Wait.NONE
        return Wait.PEER if self._waits_on else Wait.RUNTIME

    def waiting_on(self, rank: int, incarnation: int) -> _Blocked:
        """``with hb.waiting_on(rank, incarnation):`` as :attr:`blocked`, waiting on that
        one peer (a heal's other end): a judge that finds this worker waiting long follows
        the chain to the peer (:func:`fastft.launch.rules.policy.waits_chain`)."""
        return _Blocked(self, (rank, incarnation))

    def waiting(self, on: bool, *, on_peer: tuple[int, int] | None = None) -> None:
        """The main thread enters (``on``) or leaves a wait in the runtime. Waits nest (a
        heal's wait on its peer inside the runtime's wait for a recovery): leaving the inner
        one returns to the outer."""
        if on:
            self._outer.append((self._wait_since, self._waits_on))
            self._wait_since = time.monotonic()
            self._waits_on = on_peer
            self.beat()
            self._waiting.set()
            return
        since, peer = self._outer.pop() if self._outer else (0.0, None)
        self._last = time.monotonic()  # (the wait is not a silence of the main thread)
        if since:
            self._wait_since, self._waits_on = since, peer
        else:
            self._waiting.clear()
            self._wait_since = 0.0
            self._waits_on = None
        self._write(self._last)

    def sleep(self, seconds: float) -> None:
        """Sleep as a wait: the helper thread beats meanwhile (not a silence)."""
        with self.blocked:
            time.sleep(seconds)

    def between(self, on: bool) -> None:
        """The main thread leaves a step for the user's code between steps (``on``), or
        enters the next. Between steps the helper thread beats while the interpreter runs:
        an evaluation or a checkpoint is not a hang; the agent judges that time by
        ``--between-steps-timeout`` instead of ``--hang-timeout``."""
        self._between = time.monotonic() if on else 0.0
        if not on:
            self._silence = 0.0  # (a step's silences start with it)
            self._last = time.monotonic()
            if self._unsettled:  # (and an unsettled step's length)
                self._unsettled = self._last
        self.beat()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if self._waiting.is_set():
                self._write(time.monotonic())
            elif self._between or self._unsettled:
                self._write(time.monotonic())  # alive, but no progress of the main thread

    EXIT_GRACE_S = 60.0
    """After close, the agent gives the process this long to exit before it calls it hung
    (interpreter teardown, torch's thread joins: seconds on a loaded machine, no beats)."""

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self._mm is not None:
            # A last beat in the future: the worker is leaving, not hung. The commits stay:
            # they tell the agent this life committed (a worker that raised after 100
            # commits is not failing "before its first commit").
            left = time.monotonic() + self.EXIT_GRACE_S
            self._mm[0:BEAT_SIZE] = struct.pack(
                self.BEAT_FORMAT,
                left,
                self._pace,
                0.0,
                float(self._commits),
                self._compute,
                self._step,
                0.0,
                0.0,
                left,
                0.0,
                -1.0,
                float(self._epoch),
                0,
            )
            self._mm.close()
            self._mm = None
