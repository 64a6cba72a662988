"""A small GPT trained the usual way, under ``fastft run``: AdamW, warmup then cosine
decay (a LambdaLR), gradient clipping, dropout, a global loss logged with
``tx.allreduce``, an EMA copy of the weights and state of the script's own (counters, a
history of recent losses), and a weight decay changed by hand inside the step. Written
from the README, not for the tests: the zoo's test runs it under fault plans and checks
every rank bitwise against a fault-free run.

    fastft run --nproc 3 tests/zoo/lm.py --steps 30 --out OUT
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fastft

VOCAB, CONTEXT = 64, 16


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, d))
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        x = self.blocks(x, mask=self.mask[: idx.shape[1], : idx.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def batch(step: int, size: int) -> torch.Tensor:
    """The global batch of ``step``: token sequences with a learnable pattern."""
    g = torch.Generator().manual_seed(1_000 + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seq = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)


class Stats:
    """The script's own state: counters and the recent losses, registered with fastft."""

    def __init__(self) -> None:
        self.tokens = 0
        self.steps = 0
        self.recent: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "steps": self.steps, "recent": list(self.recent)}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.tokens, self.steps, self.recent = st["tokens"], st["steps"], list(st["recent"])


def write_final(out: Path | None, ft: Any, **record: Any) -> None:
    """This rank's final record in ``out`` (none without ``--out``): ``record`` and the
    step, with the rank's own commits and rollbacks (the zoo's tests compare the rest)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    record = {"step": ft.step, **record, "commits": ft.commits, "rollbacks": ft.rollbacks}
    (out / f"final-rank{ft.rank}.json").write_text(json.dumps(record))


def state_hash(*objs: Any) -> str:
    """The script's own hash of everything it holds (not fastft's digest)."""
    h = hashlib.sha256()

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            h.update(o.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                visit(o[k])
        elif isinstance(o, list | tuple):
            for v in o:
                visit(v)
        else:
            h.update(repr(o).encode())

    for o in objs:
        visit(o)
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=24, help="global batch (sequences)")
    ap.add_argument("--d", type=int, default=32, help="model width")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the model's seed")
    ap.add_argument("--nproc", type=int, default=0, help="(a flag named like fastft's)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--forget-scheduler",
        action="store_true",
        help="leave the scheduler out of ft.register (fastft must refuse it)",
    )
    ap.add_argument(
        "--flip",
        default=None,
        metavar="RANK:STEP",
        help="a faulty device: a bit of that rank's first parameter flips once, after "
        "that step's commit (not again when the steps run again)",
    )
    ap.add_argument(
        "--perturb",
        default=None,
        metavar="RANK:STEP",
        help="a bug to catch: that rank nudges its EMA copy after that step's commit",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    model = GPT(a.d, a.layers)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def warmup_cosine(step: int) -> float:
        if step < a.warmup:
            return (step + 1) / a.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - a.warmup) / max(1, a.steps - a.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    stats = Stats()
    ft = fastft.init()
    if a.forget_scheduler:
        ft.register(model=model, optimizer=opt, ema=ema, stats=stats)
    else:
        ft.register(model=model, optimizer=opt, scheduler=sched, ema=ema, stats=stats)
    flipped = False
    while ft.step < a.steps:
        with ft.transaction() as tx:
            seq = batch(tx.step, a.batch)[tx.shard(a.batch)]
            for g in opt.param_groups:  # a setting changed by hand inside the step
                g["weight_decay"] *= 0.98
            logits = model(seq[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
            (loss * len(seq) / a.batch * tx.world).backward()  # (tx.shard's weights: the mean)
            tx.allreduce_gradients()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            loss_sum, count = loss.detach() * len(seq), torch.tensor([len(seq)])
            tx.allreduce([loss_sum, count])  # the global loss, for the log (2 shapes, 2 types)
        if tx.committed:
            sched.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 0.1)
            stats.steps += 1
            stats.tokens += a.batch * CONTEXT
            stats.recent = [*stats.recent, round(float(loss_sum / count[0]), 6)][-5:]
            if a.flip == f"{ft.rank}:{ft.step - 1}" and not flipped:
                flipped = True  # (the process's own: a rewind does not bring it back)
                next(model.parameters()).data.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
            if a.perturb == f"{ft.rank}:{ft.step - 1}":
                with torch.no_grad():
                    next(ema.parameters()).add_(1e-3)
    write_final(
        a.out,
        ft,
        hash=state_hash(model.state_dict(), opt.state_dict(), ema.state_dict(), stats.state_dict()),
        last_epoch=sched.last_epoch,
        lr=opt.param_groups[0]["lr"],
        weight_decay=opt.param_groups[0]["weight_decay"],
        stats=stats.state_dict(),
    )
    ft.close()


if __name__ == "__main__":
    main()
