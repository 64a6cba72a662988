"""bench/frameworks.py's Hugging Face job: examples/hf_trainer.py's GPT-2 and data under
``fastft.hf.Trainer`` or, with ``--plain``, ``transformers.Trainer`` (under torchrun:
Accelerate's DDP), timing each optimizer step from one step's end to the next (a
callback); each rank writes its step times to ``--out``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "hf_trainer", Path(__file__).parents[1] / "examples" / "hf_trainer.py"
)
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8, help="per device")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.plain:
        from transformers import Trainer
    else:
        from fastft.hf import Trainer
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *a: object, **kw: object) -> None:
            self.ends.append(time.perf_counter())

    set_seed(0)
    config = GPT2Config(
        vocab_size=example.VOCAB,
        n_positions=example.CONTEXT,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=4,
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(args.out / "checkpoints"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
    )
    timer = StepTimes()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=example.Patterns(args.batch_size * 3 * (args.steps + 2)),
        callbacks=[timer],
    )
    trainer.train()
    rank = int(os.environ.get("FASTFT_RANK", os.environ.get("RANK", "0")))
    steps = [b - a for a, b in zip(timer.ends, timer.ends[1:], strict=False)]
    params = sum(p.numel() for p in model.parameters())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "params": params, "step_s": steps})
    )


if __name__ == "__main__":
    main()
