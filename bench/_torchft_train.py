"""Benchmark worker for bench/torchft_recovery.py: one torchft replica (DDP + optimizer
wrappers, Gloo) with ``Manager`` or ``ManagerFFT``, the MLP of bench/_train.py. Both
managers fire the fault plan (``BENCH_PLAN``) at the same point, as the gradient allreduce
is called (before torchft waits for the step's asynchronous quorum, so in some trials the
faulty replica stops before its peers' quorum is complete: the same for every variant),
and log every step's outcome with CLOCK_MONOTONIC to ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _train import batch, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manager", choices=["plain", "fft"], required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=88)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--quorum-every", type=int, default=None, help="ManagerFFT's (default: its own)"
    )
    a = ap.parse_args()
    torch.set_num_threads(1)  # as bench/_train.py: 3 replicas share 2 cores

    from torchft import DistributedDataParallel, Optimizer, ProcessGroupGloo
    from torchft.manager import Manager

    from fastft.inject import FaultPlan, Injector, execute
    from fastft.integrations.torchft import ManagerFFT

    replica = int(os.environ["REPLICA_GROUP_ID"])
    a.out.mkdir(parents=True, exist_ok=True)
    log = open(a.out / f"replica{replica}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def note(**kv: object) -> None:
        log.write(json.dumps({"t": time.monotonic(), **kv}) + "\n")

    plan_path = os.environ.get("BENCH_PLAN")
    plan = FaultPlan.load(plan_path) if plan_path else FaultPlan(faults=())

    def fire(spec: object) -> None:
        note(event="fault", kind=spec.kind.value)  # type: ignore[attr-defined]
        log.flush()
        execute(spec)  # type: ignore[arg-type]

    injector = Injector(plan, replica, int(os.environ.get("FASTFT_LIFE", "0")), executor=fire)
    base = ManagerFFT if a.manager == "fft" else Manager

    class Bench(base):  # type: ignore[misc,valid-type]
        def allreduce(self, tensor: torch.Tensor, *args: object, **kw: object) -> object:
            injector.fire_due(self.current_step(), point="collective")
            return super().allreduce(tensor, *args, **kw)

    torch.manual_seed(0)
    model = build(a.hidden, 0, a.layers)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    # torchrun would provide each replica group's store; a group here is one process
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    extra = {} if a.quorum_every is None else {"quorum_every": a.quorum_every}
    manager = Bench(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{replica}",
        timeout=timedelta(seconds=a.timeout),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        **extra,
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    life = int(os.environ.get("FASTFT_LIFE", "0"))
    if life == 0:
        # Start together: with min_replicas 1 a replica whose start-up (import torch) was
        # quicker forms the first quorum alone and trains ahead, and its fault then finds
        # its peers still at step 0 (seen in a trial: 0.66 s "recovery" that was catch-up).
        (a.out / f"up-{replica}").touch()
        deadline = time.monotonic() + 120
        groups = int(os.environ.get("NUM_REPLICA_GROUPS", "3"))
        while len(list(a.out.glob("up-*"))) < groups and time.monotonic() < deadline:
            time.sleep(0.01)
    note(event="ready", life=life)
    while manager.current_step() < a.steps:
        step = manager.current_step()
        x, y = batch(step, replica, a.batch // 3)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        note(event="commit" if manager.current_step() > step else "rollback", step=step)
    note(event="done", step=manager.current_step())
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torch 2.13's Gloo teardown at exit sometimes aborts


if __name__ == "__main__":
    main()
