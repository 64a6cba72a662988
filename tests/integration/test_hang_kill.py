"""A hung worker prints its stacks before the agent kills it: the agent waits until the
worker has taken the signal, not for a fixed time (that wait is on a fixed world's recovery
path: the replacement starts at the hung worker's exit). How long it waits is measured by
bench/hang_kill.py, not asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastft.launch.procs.children import await_signal_taken
from fastft.process.beat import STACKS_SIGNAL

pytestmark = pytest.mark.timeout(60)

HUNG = r"""
import faulthandler, signal, sys
sig = int(sys.argv[2])  # one thread only: a blocked signal stays pending
if sys.argv[1] == "block":
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
faulthandler.register(sig, all_threads=True)
print("ready", flush=True)
while True:  # holds the GIL: only a C handler can print the stacks
    pass
"""


def _start(mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HUNG, mode, str(int(STACKS_SIGNAL))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_the_kill_waits_for_the_stacks_not_for_a_fixed_time() -> None:
    p = _start("run")
    try:
        p.send_signal(STACKS_SIGNAL)
        assert await_signal_taken(p.pid, STACKS_SIGNAL)
        p.kill()
        _, err = p.communicate(timeout=10)
        assert "most recent call first" in err  # faulthandler's dump made it out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_signal_never_taken_is_waited_for_at_most_the_limit() -> None:
    p = _start("block")  # SIGUSR1 stays pending
    try:
        p.send_signal(STACKS_SIGNAL)
        assert not await_signal_taken(p.pid, STACKS_SIGNAL, max_s=0.1)
    finally:
        p.kill()
        p.wait()


def test_a_process_that_is_gone_is_not_waited_for() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not await_signal_taken(p.pid, STACKS_SIGNAL, max_s=1.0)
