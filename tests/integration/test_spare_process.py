"""Warm spare processes: a spare tells the agent when it is warm, and one that runs the
script ahead (``--spare-run-ahead``) waits in ``fastft.init()`` and becomes the worker it
is ordered to be, or ends there when it is not needed. (The pairing of spares and
restarts: tests/unit/test_spares.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fastft.launch.procs.spare import order_line
from fastft.process.env import READY_FD, SPARE_RUN_AHEAD


def test_a_spare_tells_the_agent_when_it_is_warm(tmp_path):
    """The agent's pipe gets one byte once the spare's warm-up is done (the spare_ready
    event), then the spare waits for its order."""
    r, w = os.pipe()
    p = subprocess.Popen(
        [sys.executable, "-c", "from fastft.launch.procs.spare import main; main()"],
        stdin=subprocess.PIPE,
        pass_fds=(w,),
        env={**os.environ, READY_FD: str(w)},
    )
    os.close(w)
    try:
        assert os.read(r, 1) == b"r"
        assert p.poll() is None  # warm, waiting for its order
        p.stdin.close()  # not needed: it ends
        assert p.wait(timeout=60) == 0
        assert os.read(r, 1) == b""  # one byte only, then closed
    finally:
        os.close(r)
        if p.poll() is None:
            p.kill()
            p.wait()


def _spare_main(tmp, stdin: bytes, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A spare that runs ahead: a script that prints before and after fastft.init()'s
    wait (await_order), the order (or EOF) on stdin."""
    script = tmp / "ahead.py"
    script.write_text(
        "import os\n"
        "from fastft.process.order import await_order\n"
        "print('ahead', os.environ.get('WHO'), flush=True)\n"
        "await_order()\n"
        "print('became', os.environ.get('WHO'), 'RUN_AHEAD' in str(os.environ), flush=True)\n"
    )
    argv = [sys.executable, str(script), "x"]
    return subprocess.run(
        [sys.executable, "-c", "from fastft.launch.procs.spare import main; main()"],
        input=stdin.decode(),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env, SPARE_RUN_AHEAD: json.dumps(argv), "WHO": "spare"},
    )


def test_a_spare_runs_ahead_and_becomes_the_worker_it_is_ordered(tmp_path):
    order = order_line({**os.environ, "WHO": "rank 1"}, [sys.executable, "ignored.py"])
    p = _spare_main(tmp_path, order, {})
    assert p.returncode == 0, p.stderr
    # before the order: the spare's environment; after it: the worker's, all of it
    assert p.stdout.splitlines() == ["ahead spare", "became rank 1 False"], p.stdout


def test_a_spare_not_needed_ends_in_the_wait(tmp_path):
    p = _spare_main(tmp_path, b"", {})  # the agent closed the pipe
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["ahead spare"], p.stdout
