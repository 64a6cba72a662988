"""A toy 2-stage pipeline, each stage its own fastft job (the staleness bound's demo).

Stage 0 turns the step's inputs into features (``Linear -> Tanh``) and trains them on a
local head of its own (decoupled greedy learning: no gradient flows back between the
stages); it sends its part of the features downstream with ``tx.send``. Stage 1 receives
them with ``tx.recv`` and trains a small MLP on them. So stage 0 may run ahead of stage 1,
by at most ``--max-ahead`` committed steps. Run each stage under ``fastft run``, with the
same job secret and flow store::

    fastft store --bind 127.0.0.1:29700 &              # the flow store (any store both reach)
    fastft secret new /tmp/pipe.secret
    fastft run --nproc 2 --job s0 --stage 0/2 --flow 127.0.0.1:29700 --max-ahead 2 \\
        --job-secret-file /tmp/pipe.secret -m fastft.demo.pipeline -- --steps 50 &
    fastft run --nproc 2 --job s1 --stage 1/2 --flow 127.0.0.1:29700 --max-ahead 2 \\
        --job-secret-file /tmp/pipe.secret -m fastft.demo.pipeline -- --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import fastft
from fastft.demo.train import batch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--batch", type=int, default=96, help="global batch per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    ap.add_argument("--out", type=Path, default=None, help="write the final state here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ft = fastft.init()
    stage = ft.config.stage
    if stage is None or not stage.startswith(("0/", "1/")) or not stage.endswith("/2"):
        raise SystemExit("fastft.demo.pipeline: run it as stage 0/2 or 1/2 (fastft run --stage)")
    first = stage.startswith("0/")
    torch.manual_seed(a.seed + (0 if first else 1))
    body = nn.Sequential(nn.Linear(32, a.hidden), nn.Tanh())  # stage 0's, and its own head:
    head = nn.Linear(a.hidden, 1)
    model = nn.Sequential(body, head)
    if not first:
        model = nn.Sequential(nn.Linear(a.hidden, a.hidden), nn.Tanh(), nn.Linear(a.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ft.register(model=model, optimizer=opt)
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y = batch(tx.step, a.seed, a.batch)
            mine = tx.shard(a.batch)
            if first:
                h = body(x[mine])
                tx.send(h)  # this step's features, for the member of this rank in stage 1
                pred = head(h)
            else:
                pred = model(tx.recv())  # stage 0's features of this step, once it committed it
            nn.functional.mse_loss(pred, y[mine]).backward()
            if a.step_time:
                time.sleep(a.step_time)
            tx.allreduce_gradients()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"final-rank{ft.rank}.json").write_text(
            json.dumps({"step": ft.step, "digest": ft.digest(), "pid": os.getpid()})
        )
    ft.close()


if __name__ == "__main__":
    main()
