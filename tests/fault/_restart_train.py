"""The in-process restart tests' training script: the demo's model and batches, its loop
under ``ft.run`` with every hook, and faults between steps (issue 23).

``--raise-at S,...``: after committing step S, rank ``--rank`` corrupts its model (NaN)
and raises outside any transaction, once per step number in this process;
``--raise-every N``: ... after every N-th commit instead, in lives ``--lives``;
``--rank -1``: every rank; ``--no-damage``: raise without corrupting the model (an
evaluation that failed); ``--stagger S``: rank R raises R x S seconds later;
``--hang-at S``: rank ``--rank`` stops making progress after step S, in Python (a soft
timeout interrupts it) or with the interrupter's signal blocked (``--uninterruptible``:
only the hard timeout ends it); ``--unhealthy life:L|spare``: a health check fails in
life L, or in a warm spare that took the slot. Writes ``final-rank{R}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import fastft
from fastft.demo.train import batch, build
from fastft.process.order import was_spare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--raise-at", default="")
    ap.add_argument("--raise-every", type=int, default=0)
    ap.add_argument("--lives", default="")
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--uninterruptible", action="store_true")
    ap.add_argument("--unhealthy", default="")
    ap.add_argument("--heal", default="auto")
    ap.add_argument("--soft", type=float, default=None)
    ap.add_argument("--hard", type=float, default=None)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--no-damage", action="store_true")
    ap.add_argument("--stagger", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    life = int(os.environ.get("FASTFT_LIFE", "0"))
    model = build(64, 0, 2)
    ft = fastft.init()
    mine = a.rank in (ft.rank, -1)
    if a.unhealthy == "spare":
        ft.add_health_check(lambda: "a bad spare (test)" if was_spare() else None, "spare")
    elif a.unhealthy.startswith("life:"):
        bad = int(a.unhealthy[5:])
        ft.add_health_check(lambda: life != bad or f"a bad device in life {bad} (test)", "life")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ft.register(model=model, optimizer=opt)
    raise_at = {int(s) for s in a.raise_at.split(",") if s}
    lives = {int(s) for s in a.lives.split(",") if s}
    calls = {"train": 0, "on_fault": 0, "before_restart": 0, "finalize": 0, "health": 0}

    def train() -> None:
        calls["train"] += 1
        while ft.step < a.steps:
            with ft.transaction() as tx:
                x, y = batch(tx.step, 0, a.batch)
                part = tx.shard(a.batch)
                nn.functional.mse_loss(model(x[part]), y[part]).backward()
                if a.step_time:
                    time.sleep(a.step_time)
                tx.allreduce_gradients()
            if not tx.committed or not mine:
                continue
            s = tx.step
            due = s in raise_at or (
                a.raise_every and (s + 1) % a.raise_every == 0 and (not lives or life in lives)
            )
            if due:
                raise_at.discard(s)
                time.sleep(a.stagger * ft.rank)  # (the later ranks raise as the epoch re-forms)
                if not a.no_damage:
                    with torch.no_grad():
                        next(model.parameters()).fill_(float("nan"))  # damaged: it must heal
                raise RuntimeError(f"an evaluation failed after step {s} (test)")
            if s == a.hang_at:
                a.hang_at = -1
                if a.uninterruptible:
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
                    time.sleep(3600)  # the hard timeout kills the process
                while True:  # Python that makes no progress: the soft timeout raises in it
                    time.sleep(0.05)

    def on_fault(e: BaseException) -> None:
        calls["on_fault"] += 1

    def health() -> None:
        calls["health"] += 1

    def before_restart() -> None:
        calls["before_restart"] += 1

    def finalize() -> None:
        calls["finalize"] += 1

    ft.run(
        train,
        on_fault=on_fault,
        health_check=health,
        before_restart=before_restart,
        finalize=finalize,
        heal={"auto": "auto", "yes": True, "no": False}[a.heal],
        soft_timeout_s=a.soft,
        hard_timeout_s=a.hard,
        max_restarts=100,
    )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"final-rank{ft.rank}.json").write_text(
        json.dumps(
            {"step": ft.step, "digest": ft.digest(), "pid": os.getpid(), "life": life, **calls}
        )
    )
    ft.close()


if __name__ == "__main__":
    main()
