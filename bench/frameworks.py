"""The fault-free step under each training stack fastft plugs into, against that stack's
own DDP, side by side (issue 62): 3 workers on Gloo, ~4M parameters, gradient clipping
on. Rounds alternate the two, each a new job; the step time is each rank's median over
the steps after ``--warmup``, the job's the slowest rank's; the table gives each round's
and the ratio of the medians over rounds.

* ``lightning``: the example's classifier (examples/lightning_classifier.py, ``--hidden
  2048``: 4.3M parameters) under ``FastFTStrategy`` and under Lightning's
  ``strategy="ddp", devices=3`` (which starts the other two processes itself);
* ``hf``: the example's GPT-2 (examples/hf_trainer.py, 5 layers of width 256: 4.0M
  parameters) under ``fastft.hf.Trainer`` and under ``transformers.Trainer`` in
  ``torchrun --nproc-per-node 3`` (Accelerate's DDP).

    python bench/frameworks.py [--stack lightning|hf|both] [--rounds 3] [--steps 60]

fastft: ``fastft run --nproc 3`` (the job secret on, every worker's real connections).
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

from _common import table, write

HERE = Path(__file__).parent
JOBS = {"lightning": HERE / "_lightning_train.py", "hf": HERE / "_hf_train.py"}


def run(stack: str, kind: str, out: Path, args: argparse.Namespace) -> dict[str, float]:
    job = JOBS[stack]
    flags = ["--steps", str(args.steps), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    if kind == "fastft":
        cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir"]
        cmd += [str(out / "run"), "--job", out.name, str(job), *flags]
        cmd += ["--strategy", "fastft"] if stack == "lightning" else []
    elif stack == "lightning":
        cmd = [sys.executable, str(job), "--strategy", "ddp", "--devices", "3", *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]
        cmd += ["--master-port", str(_free_port()), str(job), "--plain", *flags]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out.parent)
    if p.returncode:
        raise SystemExit(f"{kind} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert len(ranks) == 3, ranks
    medians = [statistics.median(r["step_s"][args.warmup :]) for r in ranks]
    return {"step_ms": max(medians) * 1e3, "params": ranks[0]["params"]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", choices=["lightning", "hf", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    stacks = ["lightning", "hf"] if args.stack == "both" else [args.stack]
    cols = ["stack", "round", "params", "ddp_ms", "fastft_ms", "ratio"]
    rows: list[dict[str, object]] = []
    summary: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="fastft-bench-frameworks-") as tmp:
        for stack in stacks:
            ddp_ms, ft_ms = [], []
            for i in range(args.rounds):
                got = {}
                for kind in ("ddp", "fastft") if i % 2 == 0 else ("fastft", "ddp"):
                    got[kind] = run(stack, kind, Path(tmp) / f"{stack}-{kind}{i}", args)
                ddp_ms.append(got["ddp"]["step_ms"])
                ft_ms.append(got["fastft"]["step_ms"])
                row = {
                    "stack": stack,
                    "round": i,
                    "params": int(got["ddp"]["params"]),
                    "ddp_ms": round(ddp_ms[-1], 2),
                    "fastft_ms": round(ft_ms[-1], 2),
                    "ratio": round(ft_ms[-1] / ddp_ms[-1], 3),
                }
                rows.append(row)
                print(table([row], cols), flush=True)
            ddp, ft = statistics.median(ddp_ms), statistics.median(ft_ms)
            summary[stack] = {
                "ddp_ms": round(ddp, 2),
                "fastft_ms": round(ft, 2),
                "ratio": round(ft / ddp, 3),
            }
    path = write("frameworks", rows, {"args": vars(args), "summary": summary, "target_ratio": 1.05})
    print(table(rows, cols))
    for stack, m in summary.items():
        print(
            f"{stack}: median over rounds DDP {m['ddp_ms']:.2f} ms, fastft {m['fastft_ms']:.2f} ms, "
            f"ratio {m['ratio']:.3f} (target <= 1.05)"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
