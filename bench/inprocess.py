"""Recovery from an exception outside the transaction (issue 23), three ways side by side
in one run: the loop restarted in process (``ft.run``), a warm spare (``--warm-spares 1``:
the process exits, a pre-started interpreter with torch imported becomes the worker), and
a cold restart (a new Python, its imports, the script's set-up).

3 Gloo workers on CPU, fixed world (the survivors wait for the rank: they commit with it),
the demo's MLP (``--hidden``). Rank 1 raises between steps after committing step
``FAULT_STEP`` (after damaging its parameters: every variant heals from a peer). Times
from the raise (CLOCK_MONOTONIC, as the event log's ``mono``): the survivors' next commit
and the restarted rank's next commit. ``--trials`` runs per variant, interleaved; medians
reported. Results: ``bench/results/inprocess.json`` and a table.

NVRx publishes its in-process restart's costs at scale (about 0.5 s to destroy the
process groups, 0.5 s for the rank assignment, 0.5 s for the barrier at 16k ranks; seed
document 002); they are printed beside these for reference, not measured here.

    python bench/inprocess.py [--trials 3] [--hidden 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, table, write  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

FAULT_STEP = 10
STEPS = 25
VARIANTS = {
    "in-process (ft.run)": ("--wrap",),
    "warm spare": ("--warm-spares", "1"),
    "cold restart": (),
}
NVRX_S = {"destroy process groups": 0.5, "rank assignment": 0.5, "barrier": 0.5}

WORKER = """
import json, os, sys, time
import torch
from torch import nn
import fastft
from fastft.demo.train import batch, build

wrap, hidden, out = sys.argv[1] == "wrap", int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
model = build(hidden, 0, 2)
ft = fastft.init()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
ft.register(model=model, optimizer=opt)
life = int(os.environ.get("FASTFT_LIFE", "0"))

def train():
    while ft.step < STEPS:
        with ft.transaction() as tx:
            x, y = batch(tx.step, 0, 96)
            part = tx.shard(96)
            nn.functional.mse_loss(model(x[part]), y[part]).backward()
            tx.allreduce_gradients()
        if tx.committed and tx.step == FAULT_STEP and ft.rank == 1 and life == 0 and not raised:
            raised.append(1)
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
            with open(os.path.join(out, "raised"), "w") as f:
                f.write(repr(time.monotonic()))
            raise RuntimeError("an evaluation failed (bench)")

raised = []
ft.run(train) if wrap else train()
ft.close()
"""


def one(tmp: Path, name: str, flags: tuple[str, ...], hidden: int) -> dict[str, float]:
    run = tmp / name
    run.mkdir(parents=True)
    script = run / "worker.py"
    src = WORKER.replace("STEPS", str(STEPS)).replace("FAULT_STEP", str(FAULT_STEP))
    script.write_text(src)
    wrap = "--wrap" in flags
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)),
        *("--job", name, *(f for f in flags if f != "--wrap"), str(script)),
        *("--", "wrap" if wrap else "plain", str(hidden), str(run)),
    ]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    t0 = float((run / "raised").read_text())
    ev = read_events(run)
    after = [e for e in ev if e["event"] == "commit" and e["step"] > FAULT_STEP]
    survivors = min(e["mono"] for e in after if e["src"] != "rank 1")
    rank1 = min(e["mono"] for e in after if e["src"] == "rank 1")
    steps = [e["mono"] for e in ev if e["event"] == "commit" and e["src"] == "rank 0"]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return {
        "survivors_next_commit_s": survivors - t0,
        "rank_next_commit_s": rank1 - t0,
        "step_s": statistics.median(gaps),
        "same_pid": len({e["pid"] for e in ev if e["event"] == "worker_start"}) == 3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    a = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="fastft-inprocess-") as tmp:
        progress = Progress("inprocess", a.trials * len(VARIANTS))
        for t in range(a.trials):
            for v, flags in VARIANTS.items():
                progress.next(f"{v}, trial {t + 1}")
                slug = v.split()[0].strip("-").lower()
                got[v].append(one(Path(tmp), f"{slug}-{t}", flags, a.hidden))
        progress.close()
    rows: list[dict[str, object]] = []
    base = statistics.median(x["rank_next_commit_s"] for x in got["in-process (ft.run)"])
    for v, xs in got.items():
        rank = statistics.median(x["rank_next_commit_s"] for x in xs)
        rows.append(
            {
                "variant": v,
                "survivors_next_commit_s": statistics.median(
                    x["survivors_next_commit_s"] for x in xs
                ),
                "rank_next_commit_s": rank,
                "x_in_process": rank / base,
                "step_ms": statistics.median(x["step_s"] for x in xs) * 1e3,
                "new_process": not all(x["same_pid"] for x in xs),
                "trials": len(xs),
            }
        )
    cols = list(rows[0])
    print(table(rows, cols))
    print(
        "\nNVRx in-process restart, published at 16k ranks (not measured here): "
        + ", ".join(f"{k} ~{s} s" for k, s in NVRX_S.items())
    )
    path = write(
        "inprocess",
        rows,
        {"fault_step": FAULT_STEP, "steps": STEPS, "hidden": a.hidden, "nvrx_published_s": NVRX_S},
    )
    print(f"\n{path}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
