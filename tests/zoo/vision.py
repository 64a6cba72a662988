"""A small ResNet with BatchNorm trained the usual way, under ``fastft run``: random
augmentation (crop, flip, noise) drawn from torch's RNG in the dataset's ``__getitem__``,
loaded by 2 loader worker processes (torchdata's ``StatefulDataLoader``), a linear warmup
then cosine decay (``SequentialLR``), gradient accumulation over 2 micro-batches, gradient
clipping and bf16 autocast. Written from the README, not for the tests: the zoo's tests
run it under fault plans and check every rank bitwise against a fault-free run.

    fastft run --nproc 3 tests/zoo/vision.py --steps 24 --out OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from lm import state_hash, write_final
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import fastft


class Images(Dataset):
    """Synthetic 3x20x20 images in 10 classes, augmented as torchvision does."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = i % 10
        img = torch.randn(3, 20, 20, generator=g) + label / 5
        dx, dy = torch.randint(0, 5, (2,)).tolist()  # RandomCrop(16)
        img = img[:, dy : dy + 16, dx : dx + 16]
        if torch.rand(()) < 0.5:  # RandomHorizontalFlip
            img = img.flip(-1)
        return img + 0.05 * torch.randn_like(img), label


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def resnet(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        Block(width),
        nn.MaxPool2d(2),
        Block(width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=24, help="global batch (images)")
    ap.add_argument("--samples", type=int, default=240, help="dataset size")
    ap.add_argument("--loader-workers", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=a.warmup)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps - a.warmup)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[a.warmup])
    loader = StatefulDataLoader(
        Images(a.samples),
        batch_size=a.batch,
        shuffle=True,
        num_workers=a.loader_workers,
        generator=torch.Generator().manual_seed(0),
    )
    data = fastft.Batches(loader)
    ft = fastft.init()
    ft.register(model=model, optimizer=opt, scheduler=sched, data=data)
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y = data.next()  # the step's global batch
            mine = tx.shard(len(x))
            x, y = x[mine], y[mine]
            half = len(x) // 2
            for part in (slice(0, half), slice(half, None)):  # gradient accumulation
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x[part])
                loss = F.cross_entropy(out.float(), y[part]) * len(y[part]) / a.batch
                (loss * tx.world).backward()  # (tx.shard's weights make it the global mean)
            tx.allreduce_gradients()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        if tx.committed:
            sched.step()
    if a.out is not None:
        model.eval()
        torch.manual_seed(1)  # (the evaluation's images: the same augmentation everywhere)
        with torch.no_grad():
            x = torch.stack([Images(a.samples)[i][0] for i in range(64)])
            score = float((model(x).argmax(1) == torch.arange(64) % 10).float().mean())
        write_final(
            a.out,
            ft,
            hash=state_hash(model.state_dict(), opt.state_dict(), sched.state_dict()),
            last_epoch=sched.last_epoch,
            lr=opt.param_groups[0]["lr"],
            eval=score,
        )
    ft.close()


if __name__ == "__main__":
    main()
