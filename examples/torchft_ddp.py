"""torchft's DDP example with fastft's error bus: the one change from torchft's own
``train_ddp.py`` is ``Manager`` -> ``ManagerFFT``.

Under fastft's launcher, which starts the lighthouse, one replica group per worker, and
restarts a replica that dies (the restarted one heals from a live peer):

    fastft run --torchft fastft --nproc 3 examples/torchft_ddp.py --steps 200

Under torchrun (or any launcher): a job secret every replica reads, one store for the job
that every replica group reaches, torchft's lighthouse, and each replica group told where
the bus is (``--bus``); run from the repository's root:

    fastft secret new /tmp/ddp.secret
    fastft store --bind 127.0.0.1:29600 &
    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 2 --join_timeout_ms 10000 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \
      FASTFT_SECRET_FILE=/tmp/ddp.secret torchrun --nproc-per-node 1 --master-port 29501 \
      examples/torchft_ddp.py --bus 127.0.0.1:29600 --job demo &
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \
      FASTFT_SECRET_FILE=/tmp/ddp.secret torchrun --nproc-per-node 1 --master-port 29502 \
      examples/torchft_ddp.py --bus 127.0.0.1:29600 --job demo

A replica's exception then reaches its peers in milliseconds instead of a timeout (nobody
watches for processes that die there: torchft's timeouts handle those). Each replica
prints its final step and a digest of its parameters (all replicas print the same one).
``tests/fault/test_torchft.py`` runs these lines as written, on ports of its own.
"""

import argparse
import hashlib
import os
from datetime import timedelta

import torch
from torch import nn, optim
from torchft import DistributedDataParallel, Optimizer, ProcessGroupGloo

from fastft.integrations.torchft import ManagerFFT, connect


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument(
        "--bus", default=None, help="HOST:PORT of the job's store (not under fastft run)"
    )
    ap.add_argument("--job", default="torchft-ddp", help="the job's id on the bus")
    args = ap.parse_args()
    replica_group = int(os.environ.get("REPLICA_GROUP_ID", 0))

    torch.manual_seed(0)  # every replica starts from the same weights
    m = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 8))
    inner = optim.AdamW(m.parameters(), lr=1e-3)

    def load_state_dict(state_dict):
        m.load_state_dict(state_dict["model"])
        inner.load_state_dict(state_dict["optim"])

    def state_dict():
        return {"model": m.state_dict(), "optim": inner.state_dict()}

    manager = ManagerFFT(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica_group}",
        timeout=timedelta(seconds=30),
        bus=connect(args.bus, args.job) if args.bus else None,
    )
    model = DistributedDataParallel(manager, m)
    optimizer = Optimizer(manager, inner)

    while manager.current_step() < args.steps:
        g = torch.Generator().manual_seed(manager.current_step() * 1000 + replica_group)
        inputs, labels = torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), labels)
        loss.backward()
        optimizer.step()

    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"replica {replica_group} step {manager.current_step()} digest {digest}", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
