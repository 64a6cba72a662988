"""A classifier trained from a stream, the usual way, under ``fastft run``: an
``IterableDataset`` that reads shards in the style of WebDataset (a list of shards, split
over the loader's worker processes, each shard's records in order, a random token dropout
drawn from torch's RNG as it reads), under torchdata's ``StatefulDataLoader`` with 0 or 2
workers, through ``fastft.Batches``. The zoo's tests run it under fault plans and check
every rank bitwise against a fault-free run (issue 61: the first restart ended the job,
exit 94, "'data' differs": torchdata's restored position counted batches twice). With
``--save PATH`` it keeps a checkpoint of its own (``torch.save`` every ``--save-every``
steps, from rank 0) and resumes from it when started again, telling fastft the step.

    fastft run --nproc 3 tests/zoo/stream.py --workers 2 --steps 20 --out OUT
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from lm import state_hash, write_final
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import fastft

VOCAB, LENGTH, CLASSES, SHARDS, PER_SHARD = 40, 10, 3, 8, 18


def shard(i: int) -> list[tuple[torch.Tensor, int]]:
    """Shard ``i``'s records (a file, in WebDataset's terms)."""
    g = torch.Generator().manual_seed(100 + i)
    out = []
    for _ in range(PER_SHARD):
        label = int(torch.randint(0, CLASSES, (), generator=g))
        tokens = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        out.append((torch.where(tokens % 3 == 0, label * 10 + tokens % 10, tokens), label))
    return out


class Shards(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        mine = range(SHARDS)[info.id :: info.num_workers] if info else range(SHARDS)
        for i in mine:
            for tokens, label in shard(i):
                drop = torch.rand(LENGTH) < 0.1  # augmentation, from the global RNG
                yield torch.where(drop, 0, tokens), label


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--save", type=Path, default=None, help="a checkpoint of the script's own")
    ap.add_argument("--save-every", type=int, default=4)
    a = ap.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(VOCAB, 16), nn.Dropout(0.2), nn.Linear(16, CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = StatefulDataLoader(Shards(), batch_size=a.batch, num_workers=a.workers)
    ft = fastft.init()
    data = fastft.Batches(loader)
    step = None
    if a.save is not None and a.save.exists():  # the script's own resume
        saved = torch.load(a.save, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        data.load_state_dict(saved["data"])
        step = saved["step"]
    ft.register(model=model, optimizer=opt, data=data, step=step)
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y = data.next()
            mine = tx.shard(len(x))
            loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
            (loss * len(x[mine]) / len(x) * tx.world).backward()
            tx.allreduce_gradients()
        if tx.committed and a.save is not None and ft.rank == 0 and ft.step % a.save_every == 0:
            saved = {"model": model.state_dict(), "opt": opt.state_dict(), "step": ft.step}
            torch.save({**saved, "data": data.state_dict()}, f"{a.save}.tmp")
            os.replace(f"{a.save}.tmp", a.save)  # (whole or not at all)
    write_final(
        a.out, ft, hash=state_hash(model.state_dict(), opt.state_dict()), **{"pass": data.epoch}
    )
    ft.close()


if __name__ == "__main__":
    main()
