"""torchft with and without fastft's error bus, side by side in one run, on one model
(the ~10k-parameter MLP of bench/recovery.py), 3 Gloo replicas, one fault schedule:

* ``torchft default``: torchft's ``Manager`` and lighthouse with their default timeouts
  (Gloo 60 s, Manager 30 s, lighthouse heartbeat 5 s, join 60 s); the node agent only
  restarts a replica that exits (as torchrun would);
* ``torchft lowest``: the lowest setting at which torchft still runs here (heartbeat
  100 ms, join 100 ms, Gloo 0.25 s, Manager 1 s), far below what a production job affords;
* ``ManagerFFT``: the same script with ``ManagerFFT`` and torchft's *default* timeouts,
  under ``fastft run --torchft fastft`` (BusLighthouse);
* ``fastft native``: fastft's own runtime on the same model (elastic world, cold restart).

For SIGKILL, exception, SIGSTOP and a GIL-holding hang of replica 1 as its gradient
allreduce starts (its peers are inside it): time from the fault to the moment both survivors committed again,
steps rolled back, and time until the restarted replica commits again (each run has one
warm spare). Fault-free step time: plain torchft, plain torchft with BusLighthouse, and
ManagerFFT in interleaved fault-free runs (median step after warm-up), and the median step
before the fault of each fault run.

The GIL hang is run for ManagerFFT (``--adaptive-hang``) and fastft native only: under
plain torchft the hung replica's Rust heartbeat thread keeps beating, so the survivors wait
for Gloo's timeout (60 s default) and then for the lighthouse's join timeout (60 s).

    python bench/torchft_recovery.py [--trials 3] [--faults sigkill,exception,sigstop]

Results: bench/results/torchft_recovery.json and a table.
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
from _common import table, write  # noqa: E402
from recovery import SIZES, run_fastft  # noqa: E402

from fastft.report import summarize  # noqa: E402

HERE = Path(__file__).parent
WORKER = str(HERE / "_torchft_train.py")
AT = 40
STEPS = 220
NATIVE_STEPS = 2000  # ~5 ms steps: the restarted replica must arrive before the end
VARIANTS = {  # name -> (fastft run --torchft, worker flags, lighthouse flags)
    "torchft default": ("plain", ["--manager", "plain"], []),
    "torchft lowest": (
        "plain",
        ["--manager", "plain", "--pg-timeout", "0.25", "--timeout", "1"],
        ["--lighthouse-heartbeat-ms", "100", "--lighthouse-join-ms", "100"],
    ),
    "ManagerFFT": ("fastft", ["--manager", "fft"], []),
}


STEADY = {  # fault-free pairs; the middle one splits ManagerFFT's cost from the lighthouse's
    "torchft default": VARIANTS["torchft default"],
    "torchft + BusLighthouse": ("fastft", ["--manager", "plain"], []),
    "ManagerFFT": VARIANTS["ManagerFFT"],
}


def run_replicas(
    variant: tuple[str, list[str], list[str]],
    run: Path,
    steps: int,
    *flags: str,
    env: dict[str, str] | None = None,
) -> dict[str, list[dict]]:
    """``fastft run --torchft`` 3 replicas of the worker; each replica life's log by name
    (``replica<group>-<pid>``)."""
    mode, wflags, lflags = variant
    hidden, layers = SIZES["small"]
    run.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--torchft", mode, "--nproc", "3"]
    cmd += ["--run-dir", str(run), "--job", run.name, *lflags, *flags]
    cmd += [WORKER, *wflags, "--steps", str(steps), "--hidden", str(hidden)]
    cmd += ["--layers", str(layers), "--out", str(run / "out")]
    env = {**os.environ, **(env or {}), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    (run / "launcher.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"{run.name} failed: {(p.stdout + p.stderr)[-2000:]}")
    return {
        f.stem: [json.loads(line) for line in f.read_text().splitlines()]
        for f in (run / "out").glob("replica*.jsonl")
    }


def commit_gaps(log: list[dict], lo: int, hi: int) -> list[float]:
    """Seconds between consecutive commits of steps lo..hi-1 in one replica's log."""
    return [
        b["t"] - a["t"]
        for a, b in zip(log, log[1:], strict=False)
        if a["event"] == b["event"] == "commit" and a["step"] >= lo and b["step"] < hi
    ]


def torchft_trial(variant: str, kind: str, trial: int, tmp: Path) -> dict[str, object]:
    run = tmp / f"{variant.replace(' ', '-')}-{kind}-{trial}"
    run.mkdir(parents=True)
    fault: dict[str, object] = {"kind": kind, "rank": 1, "at_step": AT, "point": "collective"}
    if kind == "gil_hang":
        fault["arg"] = 600  # holds the GIL until the agent kills it
    (run / "plan.json").write_text(json.dumps({"faults": [fault]}))
    flags = ["--warm-spares", "1"]
    if VARIANTS[variant][0] == "fastft":
        flags += ["--adaptive-hang"]
    logs = run_replicas(
        VARIANTS[variant], run, STEPS, *flags, env={"BENCH_PLAN": str(run / "plan.json")}
    )
    t_fault = min(e["t"] for v in logs.values() for e in v if e["event"] == "fault")
    survivors = [v for k, v in logs.items() if not k.startswith("replica1-")]
    restarted = [
        v for k, v in logs.items() if k.startswith("replica1-") and v[0].get("life", 0) > 0
    ]
    # The survivors' next commit of the step the fault broke (or a later one): a survivor
    # may still commit the step before it after the fault (the faulty replica was ahead).
    nexts = [
        min(e["t"] for e in v if e["event"] == "commit" and e["t"] > t_fault and e["step"] >= AT)
        for v in survivors
    ]
    rolled = sum(1 for v in survivors for e in v if e["event"] == "rollback" and e["t"] > t_fault)
    rejoin = [min(e["t"] for e in v if e["event"] == "commit") for v in restarted]
    steps = [g for v in survivors for g in commit_gaps(v, 10, AT)]
    return {
        "variant": variant,
        "fault": kind,
        "trial": trial,
        "next_commit_ms": round((max(nexts) - t_fault) * 1e3, 1),
        "steps_rolled_back": rolled,
        "rejoin_ms": round((min(rejoin) - t_fault) * 1e3, 1) if rejoin else None,
        "step_ms": round(statistics.median(steps) * 1e3, 2) if steps else None,
    }


def steady_pairs(pairs: int, steps: int, tmp: Path) -> dict[str, object]:
    """Fault-free step time in interleaved rounds of :data:`STEADY` (torchft's default
    timeouts everywhere): median gap between commits after warm-up."""
    out: dict[str, list[float]] = {v: [] for v in STEADY}
    for i in range(pairs):
        for name, variant in STEADY.items():
            logs = run_replicas(variant, tmp / f"steady-{name.replace(' ', '-')}-{i}", steps)
            gaps = [g for v in logs.values() for g in commit_gaps(v, steps // 4, steps)]
            out[name].append(statistics.median(gaps) * 1e3)
    ratios = sorted(f / t for t, f in zip(out["torchft default"], out["ManagerFFT"], strict=True))
    med = {k: round(statistics.median(v), 3) for k, v in out.items()}
    return {
        "pairs": pairs,
        "torchft_step_ms": med["torchft default"],
        "torchft_buslighthouse_step_ms": med["torchft + BusLighthouse"],
        "managerfft_step_ms": med["ManagerFFT"],
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": f"{ratios[0]:.3f}-{ratios[-1]:.3f}",
    }


def native_trial(kind: str, trial: int, tmp: Path) -> dict[str, object]:
    hidden, layers = SIZES["small"]
    plan: list[dict[str, object]] = [
        {"kind": kind, "rank": 1, "at_step": AT, "point": "collective"}
    ]
    if kind == "gil_hang":
        plan[0]["arg"] = 600
    run = run_fastft(
        hidden, layers, NATIVE_STEPS, tmp, f"native-{kind}-{trial}", plan=plan, world="elastic"
    )
    s = summarize(run)
    f = s["faults"][0]
    return {
        "variant": "fastft native",
        "fault": kind,
        "trial": trial,
        "next_commit_ms": f["recover_ms"],
        "steps_rolled_back": s["steps_rolled_back"],
        "rejoin_ms": f["rejoin_ms"],
        "step_ms": s["median_step_ms"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--faults", default="sigkill,exception,sigstop,gil_hang")
    ap.add_argument("--variants", default=",".join([*VARIANTS, "fastft native"]))
    ap.add_argument("--steady-pairs", type=int, default=3, help="fault-free pairs (0: skip)")
    ap.add_argument("--steady-steps", type=int, default=400)
    a = ap.parse_args()
    steady: dict[str, object] = {}
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="fastft-torchft-bench-") as d:
        tmp = Path(d)
        if a.steady_pairs:
            steady = steady_pairs(a.steady_pairs, a.steady_steps, tmp)
            print(json.dumps(steady), flush=True)
        for trial in range(a.trials):
            for kind in a.faults.split(","):
                for variant in a.variants.split(","):
                    if kind == "gil_hang" and variant.startswith("torchft"):
                        continue  # see the module docstring
                    if variant == "fastft native":
                        row = native_trial(kind, trial, tmp)
                    else:
                        row = torchft_trial(variant, kind, trial, tmp)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary: list[dict[str, object]] = []
    base_step = statistics.median(
        [float(r["step_ms"]) for r in rows if r["variant"] == "torchft default" and r["step_ms"]]
        or [float("nan")]
    )
    for variant in a.variants.split(","):
        for kind in a.faults.split(","):
            rs = [r for r in rows if r["variant"] == variant and r["fault"] == kind]
            if not rs:
                continue

            def med(key: str, rs: list[dict[str, object]] = rs) -> float | None:
                vals = [float(r[key]) for r in rs if r[key] is not None]  # type: ignore[arg-type]
                return round(statistics.median(vals), 1) if vals else None

            step = med("step_ms")
            summary.append(
                {
                    "variant": variant,
                    "fault": kind,
                    "trials": len(rs),
                    "next_commit_ms_p50": med("next_commit_ms"),
                    "steps_rolled_back": med("steps_rolled_back"),
                    "rejoin_ms_p50": med("rejoin_ms"),
                    "step_ms": step,
                    "step_vs_torchft": round(step / base_step, 3) if step else None,
                }
            )
    path = write(
        "torchft_recovery",
        rows,
        {"summary": summary, "steady": steady, "at_step": AT, "steps": STEPS, "nproc": 3},
    )
    print(table(summary, list(summary[0])))
    if steady:
        print(table([steady], list(steady)))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
