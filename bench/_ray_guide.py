"""The Ray guide's recovery for ``bench/ray_node_loss.py``: one actor per worker (torch +
gloo, the demo's model, data and step), rank 0 checkpointing every ``CKPT_EVERY`` steps;
on the first failure the driver kills every actor, makes new ones, and they restore the
newest checkpoint. Also the run's constants and its row of figures."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

STEPS = 200
LOSS_STEP = 25
STEP_TIME = 0.05
CKPT_EVERY = 10
BATCH = 96


def row(t_kill: float, seen: float, survivors: list, back: list, before: int) -> dict[str, float]:
    first = min(survivors, key=lambda e: e["mono"])
    return {
        "seen_ms": (seen - t_kill) * 1e3,
        "survivors_ms": (first["mono"] - t_kill) * 1e3,
        "back_ms": (min(e["mono"] for e in back) - t_kill) * 1e3,
        "redone_steps": max(0, before + 1 - first["step"]),
    }


class GuideWorker:
    """One worker of the Ray guide's design (a Ray actor): trains the demo's model with
    torch + gloo, rank 0 checkpointing every ``CKPT_EVERY`` steps, each step logged."""

    def __init__(self, rank: int, world: int, init: str, ckpt: str, log: str) -> None:
        self.rank, self.world, self.init, self.ckpt, self.log = rank, world, init, ckpt, log

    def pid(self) -> int:
        return os.getpid()

    def train(self, steps: int) -> int:
        import datetime

        import torch
        import torch.distributed as dist
        from torch import nn

        from fastft.demo.train import batch, build

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=self.init,
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=60),
        )
        model = build(64, 0, 2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        start = 0
        path = Path(self.ckpt) / "newest.pt"
        if path.exists():  # the newest checkpoint: every worker restores it
            saved = torch.load(path)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = saved["step"]
        per = BATCH // self.world
        with open(self.log, "a") as log:
            for step in range(start, steps):
                x, y = batch(step, 0, BATCH)
                mine = slice(self.rank * per, (self.rank + 1) * per)
                nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
                time.sleep(STEP_TIME)
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                dist.all_reduce(flat)
                flat /= self.world
                i = 0
                for p in model.parameters():
                    p.grad.copy_(flat[i : i + p.numel()].view_as(p))
                    i += p.numel()
                opt.step()
                opt.zero_grad()
                log.write(f"{self.rank} {step} {time.monotonic()}\n")
                log.flush()
                if self.rank == 0 and (step + 1) % CKPT_EVERY == 0:
                    tmp = path.with_suffix(".tmp")
                    state = {"model": model.state_dict(), "opt": opt.state_dict()}
                    torch.save({**state, "step": step + 1}, tmp)
                    os.replace(tmp, path)
        dist.destroy_process_group()
        return steps


def _logged(run: Path, attempt: int | None = None) -> list[tuple[int, int, float]]:
    """(rank, step, time) of every step the workers finished (of one attempt)."""
    out = []
    for f in run.glob(f"steps-*-{'*' if attempt is None else attempt}.log"):
        for line in f.read_text().splitlines():
            r, s, t = line.split()
            out.append((int(r), int(s), float(t)))
    return out


def guide_trial(ray: Any, pg: Any, run: Path) -> dict[str, float]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from fastft.bus.natscluster import free_port

    run.mkdir(parents=True)
    (run / "ckpt").mkdir()
    cls = ray.remote(GuideWorker)
    t_kill = seen = None
    attempt = 0
    while True:
        init = f"tcp://127.0.0.1:{free_port()}"  # (node 0's address: the cluster's loopback)
        actors = [
            cls.options(
                num_cpus=1,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank // 2
                ),
            ).remote(rank, 4, init, str(run / "ckpt"), str(run / f"steps-{rank}-{attempt}.log"))
            for rank in range(4)
        ]
        pids = ray.get([a.pid.remote() for a in actors], timeout=120)
        futures = [a.train.remote(STEPS) for a in actors]
        failed = False
        while True:
            done, _ = ray.wait(futures, num_returns=len(futures), timeout=0.02)
            bad = []
            for f in done:
                try:
                    ray.get(f)
                except Exception:
                    bad.append(f)
            if bad:  # (the guide: kill every actor, make new ones, restore)
                seen = seen or time.monotonic()
                failed = True
                break
            if len(done) == len(futures):
                break
            if t_kill is None and any(s >= LOSS_STEP for _, s, _ in _logged(run, 0)):
                t_kill = time.monotonic()
                for pid in pids[2:]:  # node 1's workers
                    os.kill(pid, signal.SIGKILL)
        for a in actors:
            ray.kill(a, no_restart=True)
        if not failed:
            break
        attempt += 1
        if attempt > 3:
            raise RuntimeError(f"{run}: the guide's job failed {attempt} times")
    assert t_kill is not None and seen is not None
    before = max(s for _, s, t in _logged(run, 0) if t < t_kill)
    # (the new actors' steps: after every actor was killed and made again)
    after = [{"mono": t, "step": s, "r": r} for r, s, t in _logged(run, 1)]
    survivors = [e for e in after if e["r"] in (0, 1)]
    back = [e for e in after if e["r"] in (2, 3)]
    return row(t_kill, seen, survivors, back, before)
