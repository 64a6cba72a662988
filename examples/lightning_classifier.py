"""A LightningModule trained the way Lightning's docs teach, under fastft: the one line that
changes is the Trainer's ``strategy``.

An MLP classifier with BatchNorm and dropout on a synthetic dataset (a
``LightningDataModule``), AdamW with a warmup-then-cosine schedule stepped every step
(``configure_optimizers``), gradient accumulation and clipping set on the Trainer,
``self.log`` with ``sync_dist``, a validation loop, a ``ModelCheckpoint`` every few steps,
``EarlyStopping`` on the validation loss, a ``LearningRateMonitor`` and a ``CSVLogger``. At the end each rank writes a digest of its model, optimizer and
scheduler state (``--out``), which the tests compare with the fault-free run's.

    fastft run --nproc 3 examples/lightning_classifier.py --steps 24 --out OUT
    python examples/lightning_classifier.py --strategy ddp ...   # Lightning's own DDP
                                                                 # (under torchrun)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 32, 8


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int = 128, lr: float = 3e-3, warmup: int = 4, total: int = 100):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup, total = self.hparams.warmup, self.hparams.total

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (
                1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))
            )

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Blobs(pl.LightningDataModule):
    """Gaussian blobs around one center per class (a fixed seed: every rank builds the same)."""

    def __init__(self, n: int = 2048, batch_size: int = 16) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(7)
        centers = torch.randn(CLASSES, FEATURES, generator=g) * 2
        y = torch.randint(0, CLASSES, (self.n,), generator=g)
        x = centers[y] + torch.randn(self.n, FEATURES, generator=g)
        cut = self.n * 7 // 8
        self.train_set = TensorDataset(x[:cut], y[:cut])
        self.val_set = TensorDataset(x[cut:], y[cut:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=64)


def digest(trainer: pl.Trainer, model: Classifier) -> dict:
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    opt = trainer.optimizers[0].state_dict()
    for st in opt["state"].values():
        for v in st.values():
            h.update(v.detach().cpu().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {
        "digest": h.hexdigest()[:16],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "last_epoch": sched.last_epoch,
        "lr": sched.get_last_lr()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--val-every", type=int, default=10, help="validate every N batches")
    ap.add_argument("--save-every", type=int, default=8, help="ModelCheckpoint every N steps")
    ap.add_argument("--strategy", default="fastft", help="fastft, or Lightning's own (ddp)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    pl.seed_everything(0, workers=True)
    model = Classifier(hidden=args.hidden, total=args.steps)
    data = Blobs(n=args.samples, batch_size=args.batch_size)
    if args.strategy == "fastft":
        from fastft.lightning import FastFTStrategy

        strategy: object = FastFTStrategy()  # the one line fastft changes
    else:
        strategy = args.strategy
    out = args.out or Path("lightning-out")
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=4,
        logger=CSVLogger(out / "logs", name="classifier"),
        callbacks=[
            ModelCheckpoint(
                out / "checkpoints", every_n_train_steps=args.save_every, save_top_k=-1
            ),
            EarlyStopping(monitor="val_loss", patience=50),  # (its state comes with a heal)
            LearningRateMonitor(logging_interval="step"),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(model, data)
    record = {**digest(trainer, model), "seconds": round(time.perf_counter() - t0, 3)}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"final-rank{trainer.global_rank}.json").write_text(json.dumps(record))
    print(f"rank {trainer.global_rank}: {json.dumps(record)}", flush=True)


if __name__ == "__main__":
    main()
