"""A LightningModule with manual optimization (a GAN's shape: it steps its optimizers
itself), under FastFTStrategy: refused at fit, saying what to use."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastft.lightning import FastFTStrategy


class Manual(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        opt = self.optimizers()
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = pl.Trainer(
        strategy=FastFTStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Manual(), DataLoader(data, batch_size=8))
