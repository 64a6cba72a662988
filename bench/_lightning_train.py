"""bench/lightning_step.py's job: examples/lightning_classifier.py's module and data under
a Trainer with the strategy given (fastft's, or Lightning's DDP), timing each optimizer
step from the end of one batch to the end of the next (a callback); each rank writes its
step times to ``--out``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import pytorch_lightning as pl

spec = importlib.util.spec_from_file_location(
    "lightning_classifier", Path(__file__).parents[1] / "examples" / "lightning_classifier.py"
)
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.ends.append(time.perf_counter())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="fastft")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    pl.seed_everything(0)
    model = example.Classifier(hidden=args.hidden, total=args.steps)
    data = example.Blobs(n=8192, batch_size=args.batch_size)
    if args.strategy == "fastft":
        from fastft.lightning import FastFTStrategy

        strategy: object = FastFTStrategy()
    else:
        strategy = args.strategy
    timer = StepTimes()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, data)
    params = sum(p.numel() for p in model.parameters())
    steps = [b - a for a, b in zip(timer.ends, timer.ends[1:], strict=False)]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"rank": trainer.global_rank, "params": params, "step_s": steps}
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
