"""A process that abandoned a process group in the middle of a collective (a peer died or
hung) ends with the status it asked for: ``sys.exit(3)`` -> 3, an uncaught exception -> 1,
a normal end -> 0; never a SIGABRT from the group's destructor, and never a status
rewritten to 0 (a job that failed later must not report success)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import datetime, sys, time
import torch, torch.distributed as dist
from fastft.process.teardown import keep_forever

how, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
if rank == 1:  # never joins the collective: rank 0's stays in flight
    sys.stdin.read()
    sys.exit(0)
work = pg.allreduce([torch.ones(4)])
time.sleep(0.2)
assert not work.is_completed()
keep_forever(pg)  # what the runtime and ManagerFFT do with a group they abandon
keep_forever(work)
if how == "exit3":
    sys.exit(3)
if how == "raise":
    raise RuntimeError("a failure after the recovered fault")
"""


@pytest.mark.parametrize("how, want", [("exit3", 3), ("raise", 1), ("end", 0)])
def test_the_exit_status_is_the_one_asked_for(tmp_path, how: str, want: int) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "abandon.py"
    script.write_text(SCRIPT)
    peer = subprocess.Popen(
        [sys.executable, str(script), how, "1", str(port)], stdin=subprocess.PIPE
    )
    try:
        p = subprocess.run(
            [sys.executable, str(script), how, "0", str(port)],
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        peer.kill()
        peer.wait()
    assert p.returncode == want, p.stderr[-2000:]
    assert "terminate called" not in p.stderr


FAST = r"""
import sys
import torch
from fastft.process.teardown import arm_fast_exit
from fastft.runtime.endings import JobFinished, StateLost

arm_fast_exit()
print("said before the end", end="")  # (buffered: the fast exit flushes it)
if sys.argv[1] == "lost":
    raise StateLost("every holder was lost")
if sys.argv[1] == "finished":
    raise JobFinished(7)
sys.exit(3)  # no fastft ending: the normal exit, with its status
"""


@pytest.mark.parametrize("how, want", [("lost", 86), ("finished", 0), ("other", 3)])
def test_a_fastft_ending_skips_the_teardown_and_keeps_its_status(how: str, want: int) -> None:
    """A worker that ends with a fastft ending leaves at once (torch's teardown took 2.5 s
    of a worker's end after a fatal decision here: issue 36), with its status and its
    output flushed."""
    out = subprocess.run(
        [sys.executable, "-c", FAST, how], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == want, out.stderr
    assert out.stdout == "said before the end"
