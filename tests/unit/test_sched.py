"""The run-queue waits of a process's threads (:mod:`fastft.process.sched`), read from the
kernel: a process that shares one core with two busy ones waits most of the time; one
that sleeps waits ~never."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fastft.process.sched import kept_off_s, runq_waits

pytestmark = pytest.mark.timeout(60)

BUSY = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass\n"
SLEEPY = "import time\ntime.sleep(20)\n"


def _start(code: str, cpu: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code])
    os.sched_setaffinity(p.pid, {cpu})
    return p


def test_the_longest_wait_of_one_thread_is_what_held_the_process_back():
    before = {1: 10_000_000, 2: 0, 3: 5}
    after = {1: 30_000_000, 2: 250_000_000, 4: 10**12}  # (3 ended, 4 is new: left out)
    assert kept_off_s(before, after) == 0.25
    assert kept_off_s(before, before) == 0.0 and kept_off_s({}, after) == 0.0


def test_a_process_sharing_a_core_with_busy_ones_is_kept_off_it_and_a_sleeper_is_not():
    assert runq_waits(2**22 + 12345) is None  # (no such process)
    own = runq_waits(os.getpid())
    assert own is not None and os.getpid() in own  # (the main thread is a task)
    cpu = min(os.sched_getaffinity(0))
    procs = [_start(BUSY, cpu) for _ in range(3)] + [_start(SLEEPY, cpu)]
    try:
        time.sleep(0.3)  # (started, imports done)
        first = {p.pid: runq_waits(p.pid) for p in procs}
        time.sleep(1.0)
        kept = {p.pid: kept_off_s(first[p.pid] or {}, runq_waits(p.pid) or {}) for p in procs}
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    busy = [kept[p.pid] for p in procs[:3]]
    assert all(k > 0.3 for k in busy), busy  # (three on one core: each runs ~1/3 of 1 s)
    assert kept[procs[3].pid] < 0.05  # (asleep: never runnable)
