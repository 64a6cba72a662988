"""Shard groups (issue 22), side by side in one run, 4 Gloo workers on CPU, the 4.2M model:

* **Fault-free step**: fastft's HSDP (``--shard-size 2``: FSDP2 inside each group, fastft's
  interruptible replicate reduce and per-step commit) against torch's own HSDP (FSDP2 on
  a 2-D mesh, no fault tolerance), in interleaved pairs. Target: within 5 %.
* **Recovery**: a SIGKILL of one shard rank (its group of 2 restarts on warm spares and
  heals shard to shard) against a SIGKILL of one replica of the whole model (one worker
  per replica, a warm spare): the survivors' next commit, and the heal (bytes, time).

    python bench/hsdp.py [--pairs 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import table, write

from fastft.report import summarize
from fastft.runtime import read_events

NPROC = 4
WORKER = str(Path(__file__).with_name("_hsdp_train.py"))
MODEL = ("--hidden", "1024", "--layers", "5")  # 4,232,193 parameters
SKIP = 10


def _env() -> dict[str, str]:
    return {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _step_s(out: Path) -> float:
    """The median step of the job (the slowest rank's at each step, after warm-up)."""
    per = [json.loads(f.read_text())["s"] for f in sorted(out.glob("steps-rank*.json"))]
    n = min(len(s) for s in per)
    return statistics.median(max(s[i] for s in per) for i in range(SKIP, n))


def run_torch(tmp: Path, steps: int) -> float:
    out, port = tmp / "torch", _port()
    procs = []
    for r in range(NPROC):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= {"RANK": str(r), "WORLD_SIZE": str(NPROC)}
        cmd = [sys.executable, WORKER, "--mode", "torch", "--steps", str(steps), *MODEL]
        procs.append(subprocess.Popen([*cmd, "--out", str(out)], env=env))
    try:
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"torch HSDP worker failed with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return _step_s(out)


def run_fastft(tmp: Path, name: str, steps: int, *flags: str, plan: list | None = None) -> Path:
    run = tmp / name
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(NPROC), "--run-dir"]
    cmd += [str(run), "--job", name, *flags]
    if plan:
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += [WORKER, "--mode", "fastft", "--steps", str(steps), *MODEL, "--out", str(run / "out")]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"fastft run {name} failed: {p.stderr[-2000:]}")
    return run


def recovery(tmp: Path, name: str, steps: int, *flags: str) -> dict[str, object]:
    plan = [{"kind": "sigkill", "rank": 1, "at_step": steps // 2}]
    run = run_fastft(tmp, name, steps, *flags, "--warm-spares", "2", plan=plan)
    s = summarize(run)
    first = s["faults"][0]
    heals = [
        e
        for e in read_events(run)
        if e["event"] == "heal" and e["role"] == "fetch" and e["step"] == steps // 2
    ]
    return {
        "case": name,
        "next_commit_ms": first["recover_ms"],
        "heals": len(heals),
        "heal_bytes_each": max(e["bytes"] for e in heals),
        "heal_ms_max": max(e["heal_ms"] for e in heals),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="fastft-hsdp-") as d:
        tmp = Path(d)
        pairs = []
        for i in range(a.pairs):  # interleaved: the machine's drift hits both alike
            t = run_torch(tmp / f"p{i}", a.steps)
            f = _step_s(run_fastft(tmp / f"p{i}", "fastft", a.steps, "--shard-size", "2") / "out")
            pairs.append((f / t, t, f))
        ratio, t, f = sorted(pairs)[len(pairs) // 2]
        rows.append(
            {
                "case": "fault-free step, 2x2",
                "torch_hsdp_ms": round(t * 1e3, 3),
                "fastft_hsdp_ms": round(f * 1e3, 3),
                "ratio": round(ratio, 3),
                "ratios": [round(p[0], 3) for p in pairs],
            }
        )
        rec = [
            recovery(tmp, "sigkill-shard-rank", a.steps, "--shard-size", "2"),
            recovery(tmp, "sigkill-whole-replica", a.steps),
        ]
    path = write("hsdp", rows + rec, {"nproc": NPROC, "model": "4,232,193 parameters"})
    print(table(rows, ["case", "torch_hsdp_ms", "fastft_hsdp_ms", "ratio", "ratios"]))
    print()
    print(table(rec, ["case", "next_commit_ms", "heals", "heal_bytes_each", "heal_ms_max"]))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
