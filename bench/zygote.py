"""Worker starts at fork speed (issue 37), side by side in one run: ``fastft run
--start-method zygote`` (the default: each start and restart is a fork of the node's
zygote) against ``--start-method spawn`` (a new Python that imports torch each time).

* cold restart: 3 replicas (Gloo, CPU) of the 4.2M-parameter MLP, a fixed world, no warm
  spare; one replica SIGKILLed mid-run; from the kill to the restarted replica's next
  commit (``rejoin_ms``), and to the survivors' next commit. Target: zygote <= 0.3 s p50.
* first start: from the agent's start to every replica's first commit (the zygote imports
  once and forks three; spawn imports three times on the same cores).
* memory: the node's proportional set size (PSS: shared pages split among their users,
  from ``/proc/PID/smaps_rollup``) of the workers and the zygote once the job trains; and
  of 2 idle warm spares (``--warm-spares 2``) with the zygote against 2 spawned spares;
  and how long a spare takes to warm up (a refill's cost).

    python bench/zygote.py [--trials 5] [--quick]

Results: bench/results/zygote.json and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, table, write  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

HERE = Path(__file__).parent
WORKER = str(HERE / "_train.py")
NPROC = 3
HIDDEN, LAYERS = 1024, 5  # 4,232,193 parameters (bench/recovery.py's "large")
METHODS = ("zygote", "spawn")
SPARES = 2


def _env() -> dict[str, str]:
    return {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


def pss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _sample_memory(run: Path, out: dict[str, int], stop: threading.Event) -> None:
    """Thread: once every replica committed 5 steps, the PSS of the workers and the
    zygote (the largest sample)."""
    while not stop.wait(0.2):
        try:
            ev = read_events(run)
        except (OSError, ValueError):
            continue
        commits = [e for e in ev if e["event"] == "commit"]
        if len(commits) < 5 * NPROC:
            continue
        pids = [e["pid"] for e in ev if e["event"] in ("spawn", "zygote_start")]
        total = sum(v for p in pids if (v := pss_kib(p)) is not None)
        out["pss_kib"] = max(out.get("pss_kib", 0), total)
        out["processes"] = sum(1 for p in pids if pss_kib(p) is not None)
        return


def _sample_spares(run: Path, out: dict[str, float], stop: threading.Event) -> None:
    """Once both spares are warm, the PSS of the spares and the zygote."""
    deadline = time.monotonic() + 180
    while not stop.wait(0.2):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run}: the spares were not warm after 180 s")
        try:
            ev = read_events(run)
        except (OSError, ValueError):
            continue
        ready = [e for e in ev if e["event"] == "spare_ready"]
        if len(ready) < SPARES:
            continue
        pids = [e["pid"] for e in ready] + [e["pid"] for e in ev if e["event"] == "zygote_start"]
        out["pss_kib"] = sum(v for p in pids if (v := pss_kib(p)) is not None)
        out["warm_up_ms"] = statistics.median(e["warm_up_ms"] for e in ready)
        return


def spare_trial(method: str, tmp: Path) -> dict[str, object]:
    """Idle warm spares: their (and the zygote's) PSS, and their warm-up."""
    name = f"spares-{method}"
    run = tmp / name
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(NPROC), "--job", name]
    cmd += ["--run-dir", str(run), "--start-method", method, "--warm-spares", str(SPARES)]
    cmd += [WORKER, "--mode", "fastft", "--steps", "100000", "--hidden", str(HIDDEN)]
    cmd += ["--layers", str(LAYERS), "--out", str(run / "out")]
    got: dict[str, float] = {}
    stop = threading.Event()
    job = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _sample_spares(run, got, stop)  # (returns once both are warm)
    finally:
        job.terminate()  # a drain: the workers leave at their next commit
        job.wait(timeout=120)
    return {
        "method": method,
        "spares": SPARES,
        "spares_pss_mib": round(got["pss_kib"] / 1024, 1),
        "spare_warm_up_ms": got["warm_up_ms"],
    }


def trial(method: str, trial_no: int, steps: int, at: int, tmp: Path) -> dict[str, object]:
    from fastft.report import summarize

    name = f"{method}-{trial_no}"
    run = tmp / name
    run.mkdir(parents=True)
    plan = [{"kind": "sigkill", "rank": 1 + trial_no % (NPROC - 1), "at_step": at}]
    (run / "plan.json").write_text(json.dumps({"faults": plan}))
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(NPROC), "--job", name]
    cmd += ["--run-dir", str(run), "--start-method", method, "--inject", str(run / "plan.json")]
    cmd += [WORKER, "--mode", "fastft", "--steps", str(steps), "--hidden", str(HIDDEN)]
    cmd += ["--layers", str(LAYERS), "--out", str(run / "out")]
    memory: dict[str, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_memory, args=(run, memory, stop), daemon=True)
    sampler.start()
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    stop.set()
    sampler.join(timeout=5)
    if p.returncode != 0:
        raise RuntimeError(f"fastft run {name} failed: {p.stderr[-2000:]}")
    ev = read_events(run)
    start = next(e["mono"] for e in ev if e["event"] == "agent_start")
    first: dict[str, float] = {}
    for e in ev:
        if e["event"] == "commit":
            first.setdefault(e["src"], e["mono"])
    spawns = [e for e in ev if e["event"] == "spawn"]
    f = summarize(run)["faults"][0]
    return {
        "method": method,
        "trial": trial_no,
        "first_start_ms": round((max(first.values()) - start) * 1e3, 1),
        "rejoin_ms": f["rejoin_ms"],
        "survivors_next_commit_ms": f["recover_ms"],
        "restart_how": spawns[-1]["how"][:40] if len(spawns) > NPROC else None,
        "pss_mib": round(memory["pss_kib"] / 1024, 1) if memory else None,
        "processes": memory.get("processes"),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--at-step", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="2 trials")
    a = ap.parse_args()
    trials = 2 if a.quick else a.trials
    rows: list[dict[str, object]] = []
    with (
        Progress("zygote", trials * len(METHODS)) as progress,
        tempfile.TemporaryDirectory(prefix="fastft-zygote-") as d,
    ):
        for t in range(trials):  # (interleaved: drift in the machine's load hits both)
            for method in METHODS:
                progress.next(f"{method} trial {t}")
                rows.append(trial(method, t, a.steps, a.at_step, Path(d)))
    with tempfile.TemporaryDirectory(prefix="fastft-zygote-") as d:
        spares = [spare_trial(m, Path(d)) for m in METHODS]
    summary = []
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]

        def med(key: str, rs: list[dict[str, object]] = mine) -> float | None:
            vals = [float(v) for r in rs if isinstance(v := r[key], int | float)]
            return round(statistics.median(vals), 1) if vals else None

        summary.append(
            {
                "method": method,
                "trials": len(mine),
                "rejoin_p50_ms": med("rejoin_ms"),
                "rejoin_max_ms": max(float(r["rejoin_ms"]) for r in mine),  # type: ignore[arg-type]
                "survivors_next_commit_p50_ms": med("survivors_next_commit_ms"),
                "first_start_p50_ms": med("first_start_ms"),
                "pss_p50_mib": med("pss_mib"),
            }
        )
    for row, sp in zip(summary, spares, strict=True):
        row.update({k: v for k, v in sp.items() if k != "method"})
    z, s = summary
    ratios = {
        key: round(float(s[key]) / float(z[key]), 1)  # type: ignore[arg-type]
        for key in ("rejoin_p50_ms", "first_start_p50_ms", "spares_pss_mib", "spare_warm_up_ms")
        if z[key] and s[key]
    }
    path = write(
        "zygote",
        rows,
        {
            "model_params": 4_232_193,
            "replicas": NPROC,
            "summary": summary,
            "spawn_over_zygote": ratios,
            "target": "cold restart (kill to the restarted replica's commit) <= 300 ms p50",
        },
    )
    print(table(rows, list(rows[0])))
    print()
    print(table(summary, list(summary[0])))
    print(f"\nspawn / zygote: {ratios}\n{path}")


if __name__ == "__main__":
    main()
