"""The training loop the recovery benchmark times, in two modes on the same model and data:

* ``ddp``: plain ``torch.distributed`` + ``DistributedDataParallel`` (no fault tolerance:
  the overhead floor). Launched by ``bench/recovery.py`` with MASTER_ADDR/PORT, RANK.
  ``--extra-sync`` adds one allreduce of a single element per step: what one more
  agreement round per step costs on this machine, a reference for the fault-tolerant steps,
  which agree on a decision every step.
* ``fastft``: the same step inside ``ft.transaction()``, launched by ``fastft run``.

Each rank writes ``{out}/steps-rank{r}.json``: the wall time of every step (seconds), and
the process's CPU time (all its threads) per step after the first ``WARMUP`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from fastft.demo.train import batch, build
from fastft.protocol.shards import tile

WARMUP = 10


class CpuClock:
    """CPU seconds of this process from the end of warm-up to the end of the run."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.steps = 0

    def tick(self, steps_done: int) -> None:
        if steps_done == WARMUP:
            self.start = time.process_time()
        elif steps_done > WARMUP:
            self.steps = steps_done - WARMUP

    def per_step(self) -> float | None:
        if self.start is None or not self.steps:
            return None
        return (time.process_time() - self.start) / self.steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "fastft"], required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=88)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--extra-sync", action="store_true", help="ddp: + one 1-element allreduce")
    ap.add_argument(
        "--sync-ckpt",
        type=Path,
        default=None,
        help="fastft: rank 0 saves the committed state with a synchronous dcp.save here "
        "every --every steps (the reference for fastft's asynchronous checkpoints)",
    )
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="ddp: load this fastft checkpoint before the first step (a cold restart's "
        "restore); each rank writes the wall time its first step ended",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = build(a.hidden, 0, a.layers)
    times: list[float] = []
    clock = CpuClock()
    if a.mode == "ddp":
        import torch.distributed as dist

        from fastft.process import malloc

        malloc.tune()  # the allocator settings fastft.init() makes: compare like with like
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if a.resume_from is not None:
            from fastft.runtime.durable.checkpoints import Checkpoints

            st = Checkpoints.load(a.resume_from)
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optimizer"])
        ddp = DistributedDataParallel(model)
        dist.barrier()
        for step in range(a.steps):
            t0 = time.perf_counter()
            x, y = batch(step, 0, a.batch)
            mine = slice(*tile(0, a.batch, world, rank))
            nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
            if a.extra_sync:
                dist.all_reduce(torch.ones(1))
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            clock.tick(len(times))
            if a.resume_from is not None and step == 0:
                a.out.mkdir(parents=True, exist_ok=True)
                (a.out / f"first-step-rank{rank}.json").write_text(json.dumps(time.time()))
        dist.barrier()
        # torch 2.13's Gloo teardown at exit sometimes aborts ("terminate called without
        # an active exception"): write the result and leave without destructors
        _write(a.out, rank, times, clock.per_step())
        os._exit(0)
    else:
        import fastft

        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ft = fastft.init()
        ft.register(model=model, optimizer=opt)
        rank = ft.rank
        while ft.step < a.steps:
            t0 = time.perf_counter()
            with ft.transaction() as tx:
                x, y = batch(tx.step, 0, a.batch)
                mine = tx.shard(a.batch)
                nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
                tx.allreduce_gradients()
            # as fastft's writer: one member writes the replicated state
            sync = a.sync_ckpt is not None and rank == 0
            if sync and tx.committed and ft.step % a.every == 0:
                import torch.distributed.checkpoint as dcp

                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                dcp.save(state, checkpoint_id=a.sync_ckpt / f"step-{ft.step}", no_dist=True)
            if tx.committed:
                times.append(time.perf_counter() - t0)
                clock.tick(len(times))
        cpu = clock.per_step()
        ft.close()
    _write(a.out, rank, times, cpu)


def _write(out: Path, rank: int, times: list[float], cpu_s: float | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"pid": os.getpid(), "s": times, "cpu_s_per_step": cpu_s}
    (out / f"steps-rank{rank}.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
