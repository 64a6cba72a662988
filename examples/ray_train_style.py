"""A Ray Train script the way Ray's docs teach it, on fastft: ``ray.init()``, a training
function that reads ``train.get_context()`` and calls ``train.report(metrics,
checkpoint=...)``, ``TorchTrainer`` with ``ScalingConfig(num_workers=...)`` and a
``RunConfig`` holding ``FailureConfig(max_failures=...)`` and ``CheckpointConfig``. What
changes from Ray Train: the import line (``fastft.ray`` for ``ray.train``), and the step
inside ``ft.transaction()`` (where Ray Train has ``prepare_model``'s DDP).

    ray start --head
    python examples/ray_train_style.py --num-workers 2 --steps 40

A worker's fault costs its peers a rolled-back step, not a restart of the group from the
last reported checkpoint. See docs/ray.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import ray

from fastft.ray import (
    CheckpointConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TorchTrainer,
    TrainingFailed,
    train,
)


def train_func(config: dict) -> None:
    import torch

    import fastft

    ctx = train.get_context()
    ft = fastft.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    start = None
    if checkpoint := train.get_checkpoint():  # a run again with the same name: resume
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "model.pt"))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    ft.register(model=model, optimizer=opt, step=start)
    metrics: dict = {}
    while ft.step < config["steps"]:
        with ft.transaction() as tx:
            if tx.step == config["fail_at"] and ctx.get_world_rank() == 1:
                raise ValueError(f"a bad batch at step {tx.step}")  # (a bug of the script's)
            g = torch.Generator().manual_seed(tx.step)  # the step's global batch
            x = torch.randn(config["batch"], 16, generator=g)
            y = torch.sin(x[:, :1] * 3)
            mine = tx.shard(len(x))
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            loss.backward()
            tx.allreduce_gradients()
            total = torch.stack([loss.detach() * len(x[mine]), torch.tensor(len(x[mine]))])
            tx.allreduce([total])  # (the global loss, for the report)
            time.sleep(config["step_time"])  # (--step-time: a step's compute, simulated)
        if tx.committed:
            metrics = {"step": ft.step, "loss": float(total[0] / total[1])}
            metrics["world"] = ctx.get_world_size()
            if ft.step % config["checkpoint_every"]:
                train.report(metrics)
                continue
            with tempfile.TemporaryDirectory() as d:
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": ft.step,
                }
                torch.save(state, os.path.join(d, "model.pt"))
                train.report(metrics, checkpoint=train.Checkpoint.from_directory(d))
    digest = ft.digest()  # (the state every rank ends with: equal everywhere)
    ft.close()
    train.report({**metrics, "digest": digest})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default=None, help="the Ray cluster (default: Ray's lookup)")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--storage", default=None, help="where run directories go (./runs)")
    ap.add_argument("--flags", default="", help="more fastft run flags, space-separated")
    ap.add_argument("--fail-at", type=int, default=-1, help="rank 1 raises ValueError there")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps")
    a = ap.parse_args()
    ray.init(address=a.address, log_to_driver=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "lr": 3e-3,
            "steps": a.steps,
            "batch": 32,
            "checkpoint_every": a.checkpoint_every,
            "fail_at": a.fail_at,
            "step_time": a.step_time,
        },
        scaling_config=ScalingConfig(num_workers=a.num_workers),
        run_config=RunConfig(
            name="ray-train-style",
            storage_path=a.storage,
            failure_config=FailureConfig(max_failures=3),
            checkpoint_config=CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"
            ),
            flags=a.flags.split(),
        ),
    )
    t0 = time.monotonic()
    try:
        result = trainer.fit()
    except TrainingFailed as e:
        took = time.monotonic() - t0
        out = {"failed": e.why, "after_s": round(took, 2), "path": str(e.result.path)}
        print(json.dumps({**out, "wall": time.time()}))
        raise SystemExit(1) from e
    print(
        json.dumps(
            {
                "metrics": result.metrics,
                "history": result.metrics_history,
                "checkpoint": str(result.checkpoint),
                "best": [[str(c), m] for c, m in result.best_checkpoints],
                "path": str(result.path),
                "summary": result.summary,
            }
        )
    )


if __name__ == "__main__":
    main()
