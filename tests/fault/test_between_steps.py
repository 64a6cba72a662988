"""Hangs judged where they can happen (issue 24): between steps a long evaluation is not
a hang (the heartbeat thread beats while the interpreter runs; the agent applies
``--between-steps-timeout`` there); an interpreter that stops (a thread holding the GIL)
is hung after ``--hang-timeout``; every kill prints one reason line before the stacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastft.runtime import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = r"""
import sys, time
import torch
from torch import nn
import fastft
from fastft.demo.train import batch, build

what, life_to_stall = sys.argv[1], 0
torch.set_num_threads(1)
model = build(16, 0, 1)
ft = fastft.init()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
ft.register(model=model, optimizer=opt)
while ft.step < 12:
    with ft.transaction() as tx:
        x, y = batch(tx.step, 0, 32)
        part = tx.shard(32)
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        tx.allreduce_gradients()
    if tx.committed and tx.step == 5 and ft.rank == 1 and ft.config.life == life_to_stall:
        if what == "evaluate":
            time.sleep(4.0)  # an evaluation, twice the hang timeout, no ft.no_hang_check()
        else:
            import re  # a C call that holds the GIL for ever: no Python runs in the process
            re.match(r"(a+)+$", "a" * 64 + "b")
ft.close()
"""


def run_job(tmp: Path, what: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    run = tmp / what
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "2", "--run-dir", str(run)]
    cmd += ["--hang-timeout", "2", str(script), what]
    return run, subprocess.run(cmd, capture_output=True, text=True, timeout=150)


def test_a_long_evaluation_between_steps_is_not_a_hang(tmp_path):
    run, p = run_job(tmp_path, "evaluate")
    assert p.returncode == 0, p.stderr[-3000:]
    ev = read_events(run)
    assert not [e for e in ev if e["event"] in ("worker_hung", "restart")]
    assert max(e["step"] for e in ev if e["event"] == "commit") == 11


def test_an_interpreter_stopped_between_steps_is_hung_and_the_kill_says_why(tmp_path):
    run, p = run_job(tmp_path, "stall")
    assert p.returncode == 0, p.stderr[-3000:]
    ev = read_events(run)
    (hung,) = [e for e in ev if e["event"] == "worker_hung"]
    assert hung["rank"] == 1 and not hung["between"] and hung["timeout_s"] == 2.0
    reason = "fastft: rank 1 (life 0) hung: no progress for"
    assert reason in p.stderr and "(--hang-timeout 2); killing it, its stacks follow" in p.stderr
    assert p.stderr.index(reason) < p.stderr.index("most recent call first")  # then the stacks
    assert max(e["step"] for e in ev if e["event"] == "commit") == 11
