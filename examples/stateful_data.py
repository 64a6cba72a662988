"""Training from a torchdata ``StatefulDataLoader`` (2 loader worker processes) with a model
that uses dropout, under ``fastft run``: every sample counts once across rollbacks, heals
and checkpoint restores, and a fixed world ends bitwise equal to a run without faults.

    pip install torchdata
    fastft run --nproc 3 examples/stateful_data.py --steps 40 --out OUT
    fastft run --nproc 3 --checkpoint-dir CKPT --checkpoint-every 10 \\
        examples/stateful_data.py --steps 40 --out OUT

The loader yields each step's *global* batch (its position is then the same on every
member, so a heal can copy it); ``tx.shard`` takes this member's part. Dropout draws from
torch's RNG, which fastft reseeds from (seed, step, rank) at every step attempt: a retried
step draws the same masks. ``--samples-out DIR``: each member appends the dataset indices
it trained on to a file of its own, after each commit (the tests check that every index
counts once), and the whole global batch it drew.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import fastft


class Indexed(Dataset):
    """Sample ``i``: features drawn from a generator seeded with ``i``, its target, and
    ``i`` itself (to count what was consumed)."""

    def __init__(self, n: int, salt: int = 0) -> None:
        self.n = n
        self.salt = salt

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(i + 1_000_003 * self.salt)
        x = torch.randn(16, generator=g)
        return x, torch.tanh(x[:4].sum(0, keepdim=True)), i


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=24, help="global batch per step")
    ap.add_argument("--samples", type=int, default=480, help="dataset size")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--samples-out", type=Path, default=None)
    ap.add_argument("--loader-workers", type=int, default=2, help="the loader's num_workers")
    ap.add_argument(
        "--augment-per-rank",
        action="store_true",
        help="perturb the samples by rank (a mistake: the batch check stops the job)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    salt = int(os.environ.get("LOCAL_RANK", "0")) if a.augment_per_rank else 0
    loader = StatefulDataLoader(
        Indexed(a.samples, salt),
        batch_size=a.batch,
        shuffle=True,
        num_workers=a.loader_workers,
        generator=torch.Generator().manual_seed(0),
    )
    data = fastft.Batches(loader)
    ft = fastft.init()
    ft.register(model=model, optimizer=opt, data=data)
    log = None
    if a.samples_out is not None:
        a.samples_out.mkdir(parents=True, exist_ok=True)
        log = open(a.samples_out / f"rank{ft.rank}-pid{os.getpid()}.jsonl", "a")  # noqa: SIM115
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y, idx = data.next()
            mine = tx.shard(len(x))
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            tx.allreduce_gradients()
        if tx.committed and log is not None:
            record = {"step": tx.step, "idx": idx[mine].tolist(), "batch": idx.tolist()}
            log.write(json.dumps(record) + "\n")
            log.flush()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"final-rank{ft.rank}.json").write_text(
            json.dumps({"step": ft.step, "digest": ft.digest(), "epoch": data.epoch})
        )
    ft.close()


if __name__ == "__main__":
    main()
