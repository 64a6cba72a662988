"""A text classifier trained the usual way, under ``fastft run``: a bag-of-embeddings model
with dropout, Adam, a ``StatefulDataLoader`` that shuffles **without a generator of its
own** (the loader seeds each iterator from torch's global RNG), and a plain Python
attribute of the model that the script advances after each step and that the loss reads
(a label-smoothing warmup): what a user writes, not what fastft's guide asks. The zoo's
tests run it under fault plans and check every rank bitwise against a fault-free run
(issue 61: this loader made a restarted rank's step draw other dropout masks; the
attribute was rolled back, healed and restored by nobody).

    fastft run --nproc 3 tests/zoo/text.py --steps 20 --out OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lm import state_hash, write_final
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import fastft

VOCAB, LENGTH, CLASSES = 50, 12, 4


class Reviews(Dataset):
    """Synthetic token sequences whose class sets which tokens are frequent."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = i % CLASSES
        tokens = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        hot = torch.rand(LENGTH, generator=g) < 0.4
        return torch.where(hot, label * 10 + tokens % 10, tokens), label


class Classifier(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, d)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(d, CLASSES)
        self.steps_seen = 0  # the script's own: advanced after each step, read by the loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.emb(x)))

    def smoothing(self) -> float:
        return 0.2 * min(1.0, self.steps_seen / 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    torch.manual_seed(0)
    model = Classifier(16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = StatefulDataLoader(Reviews(240), batch_size=a.batch, shuffle=True)  # no generator
    ft = fastft.init()
    data = fastft.Batches(loader)
    ft.register(model=model, optimizer=opt, data=data)
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y = data.next()
            mine = tx.shard(len(x))
            logits = model(x[mine])
            loss = nn.functional.cross_entropy(logits, y[mine], label_smoothing=model.smoothing())
            (loss * len(x[mine]) / a.batch * tx.world).backward()
            tx.allreduce_gradients()
        if tx.committed:
            model.steps_seen += 1
    write_final(
        a.out,
        ft,
        hash=state_hash(model.state_dict(), opt.state_dict()),
        steps_seen=model.steps_seen,
    )
    ft.close()


if __name__ == "__main__":
    main()
