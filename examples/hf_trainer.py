"""A small GPT-2 trained with Hugging Face's Trainer the way its docs teach, under fastft:
the one line that changes is the Trainer's import.

The model is built from a config (no download), the dataset is tokenized here (token
sequences with a learnable pattern, as a tokenizer would give them), and the
``TrainingArguments`` are the usual ones: gradient accumulation, clipping, a cosine
schedule with warmup, periodic logging, evaluation and checkpoints. At the end each rank writes a
digest of its model, optimizer and scheduler state (``--out``), which the tests compare
with the fault-free run's.

    fastft run --nproc 3 examples/hf_trainer.py --steps 16 --out OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

VOCAB, CONTEXT = 96, 32


class Patterns(Dataset):
    """Token sequences with a learnable pattern (a start and a stride), 5 % noise."""

    def __init__(self, n: int, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        seq = (start + stride * torch.arange(CONTEXT)) % VOCAB
        noise = torch.rand(seq.shape, generator=g) < 0.05
        self.ids = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def digest(trainer: object, model: torch.nn.Module) -> dict:
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    opt = trainer.optimizer  # type: ignore[attr-defined]
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            h.update(v.cpu().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    state = trainer.state  # type: ignore[attr-defined]
    losses = [round(e["loss"], 6) for e in state.log_history if "loss" in e]
    evals = [round(e["eval_loss"], 6) for e in state.log_history if "eval_loss" in e]
    return {
        "digest": h.hexdigest()[:16],
        "global_step": state.global_step,
        "lr": trainer.lr_scheduler.get_last_lr()[0],  # type: ignore[attr-defined]
        "losses": losses,
        "eval_losses": evals,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4, help="per device")
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--plain", action="store_true", help="transformers.Trainer (no fastft)")
    ap.add_argument("--out", type=Path, default=Path("hf-out"))
    args = ap.parse_args()

    if args.plain:
        from transformers import Trainer
    else:
        from fastft.hf import Trainer  # the one line fastft changes

    set_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=args.width, n_layer=args.layers, n_head=4
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(args.out / "checkpoints"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps,
        learning_rate=3e-3,
        weight_decay=0.01,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=2,
        save_steps=8,
        eval_strategy="steps",
        eval_steps=8,
        per_device_eval_batch_size=16,
        report_to="none",
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Patterns(args.samples),
        eval_dataset=Patterns(32, seed=8),
    )
    trainer.train()
    record = digest(trainer, model)
    rank = int(__import__("os").environ.get("FASTFT_RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"final-rank{rank}.json").write_text(json.dumps(record))
    print(f"rank {rank}: {json.dumps(record)}", flush=True)


if __name__ == "__main__":
    main()
