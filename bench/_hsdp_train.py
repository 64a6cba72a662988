"""The loop ``bench/hsdp.py`` times, on one model and one batch per step, two ways:

* ``torch``: torch's own HSDP without fault tolerance: FSDP2 on a 2-D mesh (replicate x
  shard) over one Gloo world (MASTER_ADDR/PORT, RANK, WORLD_SIZE set by the benchmark);
* ``fastft``: under ``fastft run``; with ``--shard-size K`` FSDP2 over ``ft.shard_mesh()``
  and fastft's replicate reduce inside ``ft.transaction()``, without it one worker per
  replica (the whole model, for the heal comparison).

Each rank writes ``{out}/steps-rank{r}.json``: the wall time of every committed step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from fastft.demo.train import batch, build
from fastft.protocol.shards import tile


def shard(model: nn.Module, mesh: object) -> None:
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["torch", "fastft"], required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--shard", type=int, default=2, help="torch: shard group size")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = build(a.hidden, 0, a.layers)
    times: list[float] = []
    if a.mode == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        from fastft.process import malloc

        malloc.tune()  # the allocator settings fastft.init() makes: compare like with like
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(
            "cpu", (world // a.shard, a.shard), mesh_dim_names=("replicate", "shard")
        )
        shard(model, mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        dist.barrier()
        for step in range(a.steps):
            t0 = time.perf_counter()
            x, y = batch(step, 0, a.batch)
            mine = slice(*tile(0, a.batch, world, rank))
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        dist.barrier()
        _write(a.out, rank, times)
        os._exit(0)  # (torch 2.13's Gloo teardown at exit sometimes aborts)
    import fastft

    ft = fastft.init()
    if ft.sharded:
        shard(model, ft.shard_mesh("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ft.register(model=model, optimizer=opt)
    while ft.step < a.steps:
        t0 = time.perf_counter()
        with ft.transaction() as tx:
            x, y = batch(tx.step, 0, a.batch)
            mine = tx.shard(a.batch)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            tx.allreduce_gradients()
        if tx.committed:
            times.append(time.perf_counter() - t0)
    rank = ft.rank
    ft.close()
    _write(a.out, rank, times)


def _write(out: Path, rank: int, times: list[float]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"steps-rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "s": times}))


if __name__ == "__main__":
    main()
