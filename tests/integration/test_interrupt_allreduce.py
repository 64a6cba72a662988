"""Three real processes on Gloo: blocked ranks are released by a peer's fault on the bus."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastft.bus import BusConfig, host_store, tcpstore_bus
from fastft.protocol import HangSuspected

WORKER = Path(__file__).with_name("_worker.py")
WORLD = 3


def spawn(store, mode):
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(WORLD), str(store.port), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(WORLD)
    ]


def finish(procs, timeout=40):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.timeout(90)
def test_rank2_raises_and_blocked_ranks_get_the_interrupt_naming_it():
    store = host_store()
    outs = finish(spawn(store, "raise"))
    assert outs[2] == {"rank": 2, "raised": True}
    for out in outs[:2]:
        assert out["interrupted"], out
        assert out["source_rank"] == 2 and out["msg_step"] == 5 and out["step"] == 5
        assert out["cause"] == "ValueError: loss is NaN"
        assert "rank 2" in out["reason"]
        assert out["blocked_s"] < 10  # released by the bus, not by Gloo's 60 s timeout


@pytest.mark.timeout(90)
def test_allreduce_with_a_sigstopped_peer_is_released_by_a_hang_notice():
    store = host_store()
    procs = spawn(store, "sigstop")
    try:
        pid = int(store.get("stopped_pid"))  # blocks until rank 2 is about to stop
        deadline = time.monotonic() + 20
        while Path(f"/proc/{pid}/stat").read_text().split()[2] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.005)
        # What the node agent does when it sees its child stop (issue 3): publish it.
        with tcpstore_bus(
            store, BusConfig(job="integ", rank=-1, incarnation=1, subscribe=False)
        ) as agent:
            time.sleep(0.2)  # let survivors block in the allreduce
            agent.broadcast(
                HangSuspected(
                    job="integ",
                    epoch=1,
                    rank=-1,
                    incarnation=1,
                    hung_rank=2,
                    hung_incarnation=pid,
                    silent_for_s=0.0,
                    stopped=True,
                )
            )
        outs = finish(procs[:2])
        for out in outs:
            assert out["interrupted"] and out["source_rank"] == 2 and out["stopped"] is True
            assert out["blocked_s"] < 10  # not Gloo's 60 s timeout
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
            for s in (p.stdout, p.stderr):
                s.close()
