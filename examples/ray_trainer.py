"""fastft on Ray the way Ray Train users write it: a training function, scaling and failure
settings, a result with the final metrics, the run directory and the checkpoint.

    ray start --head                                   # or a cluster you have
    python examples/ray_trainer.py --nodes 2 --workers-per-node 2 --steps 200

Each worker runs ``train_loop`` under fastft (an ordinary torch loop with ``fastft.init()``
and a transaction per step): a worker's fault costs its peers a rolled-back step, not a
restart of the group, and a lost node's agent actor is replaced by the node's warm
standby agent, whose workers join and heal. See docs/ray.md.
"""

from __future__ import annotations

import argparse
import json

from fastft.ray import FailureConfig, RunConfig, ScalingConfig, Trainer


def train_loop(config: dict) -> dict:
    import torch

    import fastft

    ft = fastft.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    ft.register(model=model, optimizer=opt)
    loss = torch.zeros(())
    while ft.step < config["steps"]:
        with ft.transaction() as tx:
            g = torch.Generator().manual_seed(tx.step)  # the step's global batch
            x = torch.randn(config["batch"], 16, generator=g)
            y = torch.sin(x[:, :1] * 3)
            mine = tx.shard(len(x))
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            loss.backward()
            tx.allreduce_gradients()
    metrics = {"step": ft.step, "loss": float(loss), "digest": ft.digest()}
    ft.close()
    return metrics  # rank 0's is the result's metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default=None, help="the Ray cluster (default: Ray's lookup)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--placement", choices=["strict", "spread"], default="strict")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--storage", default=None, help="where run directories go (./runs)")
    ap.add_argument("--flags", default="", help="more fastft run flags, space-separated")
    ap.add_argument(
        "--ray-init", action="store_true", help="call ray.init() first, as Ray scripts do"
    )
    a = ap.parse_args()
    if a.ray_init:  # (the Trainer then uses this connection, and leaves it open)
        import ray

        ray.init(address=a.address, log_to_driver=False)
    result = Trainer(
        train_loop,
        train_loop_config={"lr": 3e-3, "steps": a.steps, "batch": 32},
        scaling_config=ScalingConfig(
            num_nodes=a.nodes, workers_per_node=a.workers_per_node, placement=a.placement
        ),
        failure_config=FailureConfig(max_node_restarts=3),
        run_config=RunConfig(
            name="ray-example",
            storage_path=a.storage,
            checkpoint_every=a.checkpoint_every,
            flags=a.flags.split(),
        ),
        address=a.address,
    ).fit()
    print(
        json.dumps(
            {
                "metrics": result.metrics,
                "path": str(result.path),
                "checkpoint": str(result.checkpoint),
                "summary": result.summary,
            }
        )
    )


if __name__ == "__main__":
    main()
