"""The exit trace: a worker's death is reported at its start, before the kernel frees the
worker's memory and makes the exit visible to ``waitid``."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastft.launch.procs import exit_trace
from fastft.launch.procs.exit_trace import ExitTracer, decode_status

pytestmark = pytest.mark.timeout(60)

CHILD = r"""
import sys, time
from fastft.process.sentinel import start_exit_sentinel
assert start_exit_sentinel(sys.argv[1])
x = bytearray(64 << 20)
x[:: 4096] = b"\1" * len(range(0, 64 << 20, 4096))  # touch every page
print("ready", flush=True)
line = sys.stdin.readline()
sys.exit(int(line) if line.strip() else 0)
"""


class Traced:
    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / "sentinel")
        self.p = subprocess.Popen(
            [sys.executable, "-c", CHILD, self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.reports: list[tuple[int | None, int | None, object]] = []
        self.done = threading.Event()
        self.stopped = threading.Event()
        self.tracer = ExitTracer(poll_s=0.005)
        self.tracer.watch(
            self.p.pid,
            self.path,
            lambda: self.p.returncode is None,
            self._report,
            self._after,
            lambda t: self.stopped.set(),
        )
        assert self.p.stdout is not None
        assert self.p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not self.tracer.attached:
            assert time.monotonic() < deadline, "the tracer never attached"
            time.sleep(0.005)

    def _report(self, code: int | None, sig: int | None, t: float) -> None:
        # Still not visible to waitid: the sentinel holds the exit until it is let go.
        early = os.waitid(os.P_PID, self.p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        self.reports.append((code, sig, early))

    def _after(self, code: int | None, sig: int | None, t: float) -> None:
        self.done.set()

    def finish(self) -> int:
        assert self.done.wait(10), "no exit reported"
        return self.p.wait(timeout=10)


def test_sigkill_is_reported_before_the_exit_is_visible(tmp_path: Path) -> None:
    w = Traced(tmp_path)
    os.kill(w.p.pid, signal.SIGKILL)
    assert w.finish() == -signal.SIGKILL
    assert w.reports == [(None, signal.SIGKILL, None)]
    assert not os.path.exists(w.path)  # the tracer consumed the file


def test_exit_code_is_reported(tmp_path: Path) -> None:
    w = Traced(tmp_path)
    assert w.p.stdin is not None
    w.p.stdin.write("3\n")
    w.p.stdin.flush()
    assert w.finish() == 3
    assert w.reports == [(3, None, None)]


def test_a_stopped_worker_is_reported_stays_stopped_and_resumes(tmp_path: Path) -> None:
    w = Traced(tmp_path)
    os.kill(w.p.pid, signal.SIGSTOP)
    assert w.stopped.wait(10), "the stop was not reported"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{w.p.pid}/stat").read_text().split(") ")[1][0] != "T":
        assert time.monotonic() < deadline, "the worker did not stop"
        time.sleep(0.01)
    time.sleep(0.05)
    assert Path(f"/proc/{w.p.pid}/stat").read_text().split(") ")[1][0] == "T"
    os.kill(w.p.pid, signal.SIGCONT)
    assert w.p.stdin is not None
    w.p.stdin.write("0\n")  # it runs again: it reads and exits
    w.p.stdin.flush()
    assert w.finish() == 0
    assert w.reports == [(0, None, None)]


def test_a_refused_attach_falls_back_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object) -> int:
        ctypes.set_errno(1)  # EPERM
        return -1

    monkeypatch.setattr(exit_trace, "_ptrace", refuse)
    path = tmp_path / "sentinel"
    path.write_text(str(threading.get_native_id()))
    tracer = ExitTracer(poll_s=0.005)
    t = tracer.watch(os.getpid(), str(path), lambda: True, print, print)
    assert t is not None
    t.join(10)
    assert tracer.refused == os.strerror(1)
    assert "cannot trace" in caplog.text
    assert tracer.watch(os.getpid(), str(path), lambda: True, print, print) is None


def test_decode_status() -> None:
    assert decode_status(9) == (None, 9)
    assert decode_status(3 << 8) == (3, None)
    assert decode_status(0) == (0, None)
