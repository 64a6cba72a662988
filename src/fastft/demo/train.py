"""The demo's (and the tests') training script: an MLP on synthetic regression data.

Run it under ``fastft run``. The global batch of step ``s`` is drawn from a generator
seeded with (seed, s) and split over the epoch's members by ``tx.shard``, so a fault-free
run and a run with faults consume the same samples in the same order: with a fixed world
the final parameters are bitwise equal (S5); when the world shrinks every sample of every
committed step is still consumed once, and the result equals the fault-free run up to
floating-point summation order.

    fastft run --nproc 4 -m fastft.demo.train -- --steps 300 --out OUT
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
from fastft.runtime.groups.hsdp import local as local_shards


def build(hidden: int, seed: int, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    mods: list[nn.Module] = [nn.Linear(32, hidden), nn.Tanh()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.Tanh()]
    mods.append(nn.Linear(hidden, 1))
    return nn.Sequential(*mods)


def batch(step: int, seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same samples whoever is alive."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(size, 32, generator=g)
    y = torch.sin(x[:, :1] * 3) + 0.1 * x[:, 1:2]
    return x, y


def parser() -> argparse.ArgumentParser:
    """The demo's flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=96, help="global batch per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sgd", action="store_true", help="plain SGD instead of Adam")
    ap.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="simulated compute: extra seconds per step for a part of batch/nproc samples, "
        "in proportion to the samples a member actually gets",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="every N-th step computes 3x as long (an evaluation inside the step; with "
        "--step-time): the hang check must not take it for a hang",
    )
    ap.add_argument("--out", type=Path, default=None, help="write final state here")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model trains (cuda: cuda:LOCAL_RANK, modulo the GPUs visible)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device is visible")
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        dev = torch.device("cuda", local % torch.cuda.device_count())

    model = build(a.hidden, a.seed, a.layers).to(dev)  # built on the CPU: the same everywhere
    ft = fastft.init()
    if ft.sharded:  # `fastft run --shard-size K`: K workers shard one copy (FSDP2, HSDP)
        from torch.distributed.fsdp import fully_shard

        mesh = ft.shard_mesh(dev.type)
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05)
        if a.sgd
        else torch.optim.Adam(model.parameters(), lr=1e-2)
    )
    ft.register(model=model, optimizer=opt)
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y = batch(tx.step, a.seed, a.batch)
            mine = tx.shard(a.batch)  # this member's samples of the step's global batch
            loss = nn.functional.mse_loss(model(x[mine].to(dev)), y[mine].to(dev))
            loss.backward()
            if a.step_time:  # compute in proportion to the samples, as a real model's
                share = a.step_time * (mine.stop - mine.start) * ft.config.world_size / a.batch
                heavy = a.eval_every and tx.step % a.eval_every == 0  # (3x: an evaluation)
                time.sleep(share * (3 if heavy else 1))
            tx.allreduce_gradients()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        # (with shard groups: this member's shards)
        torch.save(local_shards(model.state_dict()), a.out / f"final-rank{ft.rank}.pt")
        (a.out / f"final-rank{ft.rank}.json").write_text(
            json.dumps(
                {
                    "step": ft.step,
                    "digest": ft.digest(),
                    "pid": os.getpid(),
                    "commits": ft.commits,
                    "rollbacks": ft.rollbacks,
                }
            )
        )
    ft.close()


if __name__ == "__main__":
    main()
