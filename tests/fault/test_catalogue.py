"""Every kind of the fault catalogue, executed for real in a child process."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import sys, time, threading
from fastft.inject import FaultSpec, execute, InjectedFault, StateLostFault
spec = FaultSpec(sys.argv[1], rank=0, arg=float(sys.argv[2]))
if spec.kind.value == "gil_hang":
    beats = []
    threading.Thread(target=lambda: [beats.append(print("beat", flush=True))
                                     or time.sleep(0.01) for _ in range(10**6)],
                     daemon=True).start()
    time.sleep(0.2)
    print("hang", flush=True)
try:
    execute(spec)
except InjectedFault:
    sys.exit(41)
except StateLostFault:
    sys.exit(42)
print("returned", flush=True)
"""


def run_child(kind, arg=0.0):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, kind, str(arg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        bufsize=0,
    )


@pytest.mark.parametrize(
    "kind, arg, expect",
    [
        ("exception", 0, 41),
        ("state_lost", 0, 42),
        ("sigkill", 0, -signal.SIGKILL),
        ("sigterm", 0, -signal.SIGTERM),
        ("segfault", 0, -signal.SIGSEGV),
        ("exit", 7, 7),
    ],
)
def test_fault_kinds_end_the_process_as_documented(kind, arg, expect):
    p = run_child(kind, arg)
    p.communicate(timeout=60)
    assert p.returncode == expect


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_sigstop_stops_the_process():
    p = run_child("sigstop")
    try:
        deadline = time.monotonic() + 60
        while _state(p.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=10)


def drain(fd):
    out = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out


def test_gil_hang_freezes_every_python_thread():
    p = run_child("gil_hang", 30)
    try:
        lines = []
        deadline = time.monotonic() + 60
        # (print writes its text and its newline apart: the beat thread's "beat" can land
        # on the same line as "hang", and nothing runs after it to print another line)
        while not any("hang" in line for line in lines):
            assert time.monotonic() < deadline
            lines.append(p.stdout.readline().decode().strip())
        # after "hang", the heartbeat thread may print a line or two, then nothing at all
        fd = p.stdout.fileno()
        time.sleep(0.3)
        drain(fd)
        time.sleep(0.5)
        second = drain(fd)
        assert second == b"", f"a thread kept running: {second!r}"
        assert p.poll() is None
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
