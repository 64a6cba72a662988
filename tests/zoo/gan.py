"""A small GAN trained the usual way, under ``fastft run``: a generator and a discriminator
(BatchNorm in the discriminator), an Adam for each at its own settings, a scheduler for
each, both nets updated every step from the same batch (the generator's loss through the
discriminator, whose gradients from it are then dropped; the discriminator's from real and
detached fake samples). Registered as the guide says: the nets as one module, the two
optimizers as a list. The zoo's tests run it under fault plans and check every rank
bitwise against a fault-free run (issue 61: exact before only by a route no doc showed).

    fastft run --nproc 3 tests/zoo/gan.py --steps 16 --out OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lm import state_hash, write_final
from torch import nn

import fastft

NOISE = 8


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: real points on a ring of 4 clusters, and the noise."""
    g = torch.Generator().manual_seed(5_000 + step)
    angle = torch.randint(0, 4, (size,), generator=g) * (torch.pi / 2)
    real = torch.stack([angle.cos(), angle.sin()], 1) * 2 + 0.1 * torch.randn(size, 2, generator=g)
    return real, torch.randn(size, NOISE, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(NOISE, 32), nn.ReLU(), nn.Linear(32, 2))
    disc = nn.Sequential(nn.Linear(2, 32), nn.BatchNorm1d(32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    nets = nn.ModuleDict({"gen": gen, "disc": disc})
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, 5, gamma=0.7)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, 0.95)
    bce = nn.BCEWithLogitsLoss()
    ft = fastft.init()
    ft.register(model=nets, optimizer=[opt_g, opt_d], sched_g=sched_g, sched_d=sched_d)
    while ft.step < a.steps:
        with ft.transaction() as tx:
            real, z = batch(tx.step, a.batch)
            mine = tx.shard(a.batch)
            weight = len(real[mine]) / a.batch * tx.world  # (tx.shard's weights: the mean)
            fake = gen(z[mine])
            ones, zeros = torch.ones(len(fake), 1), torch.zeros(len(fake), 1)
            (bce(disc(fake), ones) * weight).backward()  # the generator's loss
            for p in disc.parameters():  # (the discriminator learns from its own loss only)
                if p.grad is not None:
                    p.grad.zero_()
            loss_d = bce(disc(real[mine]), ones) + bce(disc(fake.detach()), zeros)
            (loss_d * weight).backward()
            tx.allreduce_gradients()
        if tx.committed:
            sched_g.step()
            sched_d.step()
    write_final(
        a.out,
        ft,
        hash=state_hash(nets.state_dict(), opt_g.state_dict(), opt_d.state_dict()),
        lr=[opt_g.param_groups[0]["lr"], opt_d.param_groups[0]["lr"]],
    )
    ft.close()


if __name__ == "__main__":
    main()
