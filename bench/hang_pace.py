"""Hangs judged by the job's pace (issue 50), side by side in one run: ``fastft run`` (4
Gloo workers, the job secret on) training the demo at a 60 ms step, with the agent's
default (a worker silent in a step for 10x its recent steps' compute, at least 0.5 s)
against ``--no-hang-pace`` (``--hang-timeout`` alone, 30 s by default).

1. A GIL hang (``gil_hang``: no thread of the worker runs) at step 250: when the agent
   killed it (its silence at the kill) and the survivors' next commit after the hang
   began. Target: known in at most 1 s at a 60 ms step.
2. Fault-free, ``--duration`` seconds (600 by default) with a step time that varies 3x
   (every 100th step computes 3x as long: an evaluation inside the step): the hang kills
   (every one a false kill). Target: none.

    python bench/hang_pace.py [--duration 600] [--step-time 0.06]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, table, write  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

HANG_AT = 250
"""(past the pace's first 200 steps: a life's first steps judge it by their largest)"""


def job(out: Path, name: str, a: argparse.Namespace, steps: int, *flags: str) -> Path:
    d = out / name
    d.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "4", "--run-dir", str(d)]
    cmd += ["--job", name, *flags, "-m", "fastft.demo.train", "--", "--steps", str(steps)]
    cmd += ["--step-time", str(a.step_time), "--eval-every", "100", "--out", str(d / "out")]
    with open(d / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.duration * 3 + 600)
    if p.returncode != 0:
        raise SystemExit(f"{name}: exit status {p.returncode}; see {d / 'launcher.log'}")
    return d


def hang(out: Path, a: argparse.Namespace, name: str, *flags: str) -> dict[str, Any]:
    plan = out / "hang.json"
    plan.write_text(
        json.dumps({"faults": [{"kind": "gil_hang", "rank": 1, "at_step": HANG_AT, "arg": 600}]})
    )
    d = job(out, name, a, HANG_AT + 100, "--inject", str(plan), *flags)
    ev = read_events(d)
    (fired,) = [e for e in ev if e["event"] == "injected" and e["kind"] == "gil_hang"]
    (hung,) = [e for e in ev if e["event"] == "worker_hung"]
    after = [
        e["mono"]
        for e in ev
        if e["event"] == "commit" and e["src"] != "rank 1" and e["step"] >= HANG_AT
    ]
    return {
        "hang check": name,
        "timeout_s": hung["timeout_s"],
        "known_after_s": round(hung["detected"] - fired["mono"], 3),
        "survivors_next_commit_s": round(min(after) - fired["mono"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="fault-free seconds")
    ap.add_argument("--step-time", type=float, default=0.06)
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="fastft-hang-pace-"))
    progress = Progress("hang_pace", 3)
    progress.next("a GIL hang, by the worker's pace")
    rows = [hang(out, a, "pace (default)")]
    progress.next("a GIL hang, --no-hang-pace")
    rows.append(hang(out, a, "--hang-timeout alone (30 s)", "--no-hang-pace"))
    progress.next(f"fault-free, {a.duration:.0f} s, every 100th step 3x")
    steps = int(a.duration / (a.step_time + 0.008))
    t = time.monotonic()
    d = job(out, "fault-free", a, steps)
    took = time.monotonic() - t
    progress.close()
    ev = read_events(d)
    kills = [e for e in ev if e["event"] == "worker_hung"]
    paces = sorted(e["timeout_s"] for e in kills)
    free = {
        "seconds": round(took, 1),
        "steps": steps,
        "false_hang_kills": len(kills),
        "timeouts_s": paces,
    }
    path = write("hang_pace", rows, {"fault_free": free, "args": vars(a), "runs": str(out)})
    print(table(rows, ["hang check", "timeout_s", "known_after_s", "survivors_next_commit_s"]))
    print(f"fault-free: {steps} steps in {took:.0f} s (every 100th 3x): {len(kills)} hang kills")
    print(f"written {path}")
    return 0 if not kills else 1


if __name__ == "__main__":
    sys.exit(main())
