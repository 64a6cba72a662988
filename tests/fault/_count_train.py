"""A training script that counts its worker's control-store requests (issue 35): the
coordinator's store clients (the main thread's, the decision waits', and the side
client's clones) are wrapped in a counter before the runtime builds on them. After each
commit it records the count so far; it writes ``counts-rank{R}.json``. It counts the
allreduces its process groups run too (every one, fastft's and the script's: issue 65's
in-band vote), in ``allreduces-rank{R}.json``."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import torch
from torch import nn

import fastft
import fastft.runtime.api as api
from fastft.demo.train import batch, build
from fastft.testing import CountingStore
from fastft.testing.collectives import count_allreduces


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    counts: dict[str, int] = {}
    lock = threading.Lock()
    real = api.build_engine

    def counted(config, me, keys, store, control, decisions, *rest):  # type: ignore[no-untyped-def]
        control = CountingStore(control, counts, lock)
        decisions = CountingStore(decisions, counts, lock)
        return real(config, me, keys, store, control, decisions, *rest)

    api.build_engine = counted
    reduces = count_allreduces()
    torch.set_num_threads(1)
    model = build(64, 0, 2)
    ft = fastft.init()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ft.register(model=model, optimizer=opt)
    after: list[dict[str, int]] = []
    collectives: list[int] = []
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y = batch(tx.step, 0, 96)
            part = tx.shard(96)
            nn.functional.mse_loss(model(x[part]), y[part]).backward()
            tx.allreduce_gradients()
        if tx.committed:
            with lock:
                after.append(dict(counts))
            collectives.append(reduces[0])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"counts-rank{ft.rank}.json").write_text(json.dumps(after))
    (a.out / f"allreduces-rank{ft.rank}.json").write_text(json.dumps(collectives))


if __name__ == "__main__":
    main()
