"""Shared fixtures. Every test is checked for leftovers: no child process, no fastft thread."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from fastft.bus import host_store


def _fastft_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fastft-")}


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fail a test that leaves a child process or a fastft thread behind; kill what it left
    (only our own children, by PID)."""
    me = psutil.Process()
    before_children = {p.pid for p in me.children(recursive=True)}
    before_threads = _fastft_threads()
    yield
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        left = [p for p in me.children(recursive=True) if p.pid not in before_children]
        threads = [
            t
            for t in _fastft_threads() - before_threads
            if t.is_alive()
            and not t.name.startswith("fastft-bus-drain")
            and t.name != "fastft-nats"  # the process's one NATS loop (fastft.bus.nats)
        ]
        if not left and not threads:
            return
        time.sleep(0.02)
    for p in left:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"test left processes behind: {[p.pid for p in left]}"
    assert not threads, f"test left threads behind: {[t.name for t in threads]}"


@pytest.fixture
def store():
    """A TCPStore server on 127.0.0.1 with a port the OS chose."""
    s = host_store()
    yield s
    del s
