"""How long the machine kept a process's threads off the CPU: the kernel's run-queue wait
per thread (``/proc/PID/task/TID/schedstat``, its second field: nanoseconds spent runnable
but not running). A worker silent because the machine did not run it (2 cores shared by
a dozen processes, one thread holding the GIL while it waits for a core) is not hung; a
worker stuck in a collective or a sleep is not runnable, and waits ~0 there.

:func:`runq_waits` reads (the agent's shell); :func:`kept_off_s` compares two reads
(pure); :class:`KeptOff` measures one silence with them (the agent's hang verdict, the
in-process watchdog's)."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["KeptOff", "kept_off_s", "runq_waits"]


def runq_waits(pid: int) -> dict[int, int] | None:
    """Each thread's total run-queue wait (ns) by thread id; None where the kernel does not
    tell (no such process, no ``schedstat``: a kernel without ``CONFIG_SCHED_INFO``)."""
    task = f"/proc/{int(pid)}/task"
    try:
        tids = os.listdir(task)
    except OSError:
        return None
    waits: dict[int, int] = {}
    for tid in tids:
        try:
            with open(f"{task}/{tid}/schedstat", "rb") as f:
                fields = f.read(128).split()
            waits[int(tid)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # (a thread that ended between the listing and the read)
    return waits or None


def kept_off_s(before: Mapping[int, int], after: Mapping[int, int]) -> float:
    """The longest any one thread waited for a CPU between two reads (seconds): a thread
    that holds the GIL while it waits stops every other Python thread, so the largest, not
    the sum, is what held the process back. Threads in only one read are left out."""
    waited = [after[t] - before[t] for t in before.keys() & after.keys()]
    return max([w for w in waited if w > 0], default=0) / 1e9


class KeptOff:
    """The share of a process's current silence the machine kept it off the CPU, measured
    from a read of its run-queue waits taken once the silence passed half its ``limit``
    (a silence is named by ``life``: a new one starts the measure again). 0 while the
    silence is within the limit, or where the kernel does not tell; past the limit before
    a quarter of it was measured: 1.0 (not judged yet)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._life: object = None
        self._at = 0.0
        self._waits: dict[int, int] | None = None
        self.told = False
        """The caller's: whether this silence's deferral was reported (reset with it)."""

    def share(self, life: object, silent: float, limit: float, now: float) -> float:
        if silent <= limit / 2:
            self._waits = None
            return 0.0
        if self._waits is None or self._life != life:
            self._waits = runq_waits(self.pid)
            self._life, self._at, self.told = life, now, False
            if self._waits is None:
                return 0.0
        if silent <= limit:
            return 0.0  # (no verdict to weigh yet)
        if not self.measured(now, limit):
            return 1.0
        waits = runq_waits(self.pid)
        return min(1.0, kept_off_s(self._waits, waits) / (now - self._at)) if waits else 0.0

    def measured(self, now: float, limit: float) -> bool:
        """Whether a quarter of ``limit`` has been measured of this silence."""
        return self._waits is not None and now - self._at >= limit / 4
