"""The fault-free step of a LightningModule under fastft's strategy against the same
module under Lightning's own DDP, side by side (issue 62): 3 workers on Gloo, the
example's classifier (examples/lightning_classifier.py) at ``--hidden 2048`` (4.3M
parameters), gradient clipping on, no validation. Rounds alternate the two, each a new
job; the step time is each rank's median over the steps after ``--warmup``, the job's the
slowest rank's; the table gives each round's and the ratio of the medians over rounds.

    python bench/lightning_step.py [--rounds 3] [--steps 60] [--hidden 2048]

fastft: ``fastft run --nproc 3`` (the job secret on, every worker's real connections);
DDP: Lightning's ``strategy="ddp", devices=3`` (it starts the other two processes itself).
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
JOB = HERE / "_lightning_train.py"


def run(kind: str, out: Path, args: argparse.Namespace) -> dict[str, float]:
    flags = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    if kind == "fastft":
        cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir"]
        cmd += [str(out / "run"), "--job", out.name, str(JOB), "--strategy", "fastft", *flags]
    else:
        cmd = [sys.executable, str(JOB), "--strategy", "ddp", "--devices", "3", *flags]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out.parent)
    if p.returncode:
        raise SystemExit(f"{kind} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert len(ranks) == 3, ranks
    medians = [statistics.median(r["step_s"][args.warmup :]) for r in ranks]
    return {"step_ms": max(medians) * 1e3, "params": ranks[0]["params"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastft-bench-lightning-") as tmp:
        for i in range(args.rounds):
            row: dict[str, object] = {"round": i}
            for kind in ("ddp", "fastft") if i % 2 == 0 else ("fastft", "ddp"):
                got = run(kind, Path(tmp) / f"{kind}{i}", args)
                row[f"{kind}_ms"], row["params"] = round(got["step_ms"], 2), got["params"]
            row["ratio"] = round(float(row["fastft_ms"]) / float(row["ddp_ms"]), 3)  # type: ignore[arg-type]
            rows.append(row)
            print(table([row], ["round", "params", "ddp_ms", "fastft_ms", "ratio"]), flush=True)
    ddp = statistics.median(float(r["ddp_ms"]) for r in rows)  # type: ignore[arg-type]
    ft = statistics.median(float(r["fastft_ms"]) for r in rows)  # type: ignore[arg-type]
    summary = {"ddp_ms": round(ddp, 2), "fastft_ms": round(ft, 2), "ratio": round(ft / ddp, 3)}
    path = write(
        "lightning_step", rows, {"args": vars(args), "summary": summary, "target_ratio": 1.05}
    )
    print(table(rows, ["round", "params", "ddp_ms", "fastft_ms", "ratio"]))
    print(
        f"median over rounds: DDP {ddp:.2f} ms, fastft {ft:.2f} ms, ratio {ft / ddp:.3f} (target <= 1.05)"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
