"""The agent's warm spares on a GPU machine: each warms the GPU of the worker it is likely to
replace, and a restart takes a spare that warmed the dead worker's GPU when there is one.
(The warming itself runs on GPU machines: bench/gpu_check.py.) A spare that runs the script
ahead (``--spare-run-ahead``) waits in ``fastft.init()`` and becomes the worker it is
ordered to be, or ends there when it is not needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

from fastft.launch.agent import Agent
from fastft.launch.spare import READY_FD, await_order, order_line
from fastft.runtime.contract import SPARE_RUN_AHEAD


def _agent(
    spares: dict[int, int | None],
    gpus: int = 2,
    dead: set[int] = frozenset(),
    ready: set[int] | None = None,
):
    a = Agent.__new__(Agent)  # the pairing only: no store, no processes
    a._lock = threading.Lock()
    a._gpus = gpus
    a._spares = [SimpleNamespace(pid=pid) for pid in spares]
    a._spare_gpu = {pid: g for pid, g in spares.items() if g is not None}
    a._dead_spares = set(dead)
    a._ready_spares = set(spares) if ready is None else set(ready)
    return a


def _pid(taken):
    return None if taken is None else taken[0].pid


def test_a_restart_takes_the_spare_that_warmed_its_gpu():
    a = _agent({10: 0, 11: 1, 12: 0})
    assert _pid(a._take_spare(1)) == 11
    assert _pid(a._take_spare(1)) == 10  # none left for GPU 1: any live spare
    assert _pid(a._take_spare(0)) == 12
    assert a._take_spare(0) is None
    assert a._spare_gpu == {}


def test_dead_spares_are_skipped_and_a_cpu_job_takes_them_in_order():
    a = _agent({10: None, 11: None, 12: None}, gpus=0, dead={10})
    assert [_pid(a._take_spare()), _pid(a._take_spare()), a._take_spare()] == [11, 12, None]


def test_a_restart_prefers_a_spare_that_is_ready():
    """A spare still warming up has its imports left: a ready one goes first (after the
    GPU it warmed), and the restart learns whether it got a ready one."""
    a = _agent({10: None, 11: None, 12: None}, gpus=0, ready={11})
    spare, ready = a._take_spare()
    assert (spare.pid, ready) == (11, True) and a._ready_spares == set()
    assert a._take_spare()[0].pid == 10  # none ready: the oldest
    b = _agent({10: 0, 11: 1, 12: 0}, ready={10, 11})
    assert [(p.pid, r) for p, r in [b._take_spare(0), b._take_spare(0)]] == [
        (10, True),
        (12, False),
    ]


def test_a_spare_tells_the_agent_when_it_is_warm(tmp_path):
    """The agent's pipe gets one byte once the spare's warm-up is done (the spare_ready
    event), then the spare waits for its order."""
    r, w = os.pipe()
    p = subprocess.Popen(
        [sys.executable, "-c", "from fastft.launch.spare import main; main()"],
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


def test_workers_map_to_gpus_as_torchrun_places_them():
    a = _agent({}, gpus=4)
    assert [a._gpu_of(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert _agent({}, gpus=0)._gpu_of(3) is None  # no GPU: spares warm none


def _spare_main(tmp, stdin: bytes, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A spare that runs ahead: a script that prints before and after fastft.init()'s
    wait (await_order), the order (or EOF) on stdin."""
    script = tmp / "ahead.py"
    script.write_text(
        "import os\n"
        "from fastft.launch.spare import await_order\n"
        "print('ahead', os.environ.get('WHO'), flush=True)\n"
        "await_order()\n"
        "print('became', os.environ.get('WHO'), 'RUN_AHEAD' in str(os.environ), flush=True)\n"
    )
    argv = [sys.executable, str(script), "x"]
    return subprocess.run(
        [sys.executable, "-c", "from fastft.launch.spare import main; main()"],
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


def test_await_order_is_a_no_op_in_a_worker(monkeypatch):
    monkeypatch.delenv(SPARE_RUN_AHEAD, raising=False)
    await_order()  # returns at once: no stdin read
