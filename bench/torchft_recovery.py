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
warm spare). Fault-free step time: plain torchft vs ManagerFFT in interleaved fault-free
runs (median step after warm-up), and the median step before the fault of each fault run.

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


def torchft_trial(variant: str, kind: str, trial: int, tmp: Path) -> dict[str, object]:
    mode, wflags, lflags = VARIANTS[variant]
    name = f"{variant.replace(' ', '-')}-{kind}-{trial}"
    run = tmp / name
    run.mkdir(parents=True)
    fault: dict[str, object] = {"kind": kind, "rank": 1, "at_step": AT, "point": "collective"}
    if kind == "gil_hang":
        fault["arg"] = 600  # holds the GIL until the agent kills it
    (run / "plan.json").write_text(json.dumps({"faults": [fault]}))
    hidden, layers = SIZES["small"]
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--torchft", mode, "--nproc", "3"]
    cmd += ["--warm-spares", "1", "--run-dir", str(run), "--job", name, *lflags]
    if mode == "fastft":
        cmd += ["--adaptive-hang"]
    cmd += [WORKER, *wflags, "--steps", str(STEPS), "--hidden", str(hidden)]
    cmd += ["--layers", str(layers), "--out", str(run / "out")]
    env = {**os.environ, "BENCH_PLAN": str(run / "plan.json"), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    (run / "launcher.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"{name} failed: {(p.stdout + p.stderr)[-2000:]}")
    logs: dict[str, list[dict]] = {}
    for f in (run / "out").glob("replica*.jsonl"):
        logs[f.stem] = [json.loads(line) for line in f.read_text().splitlines()]
    fault = min(e["t"] for v in logs.values() for e in v if e["event"] == "fault")
    survivors = [v for k, v in logs.items() if not k.startswith("replica1-")]
    restarted = [
        v for k, v in logs.items() if k.startswith("replica1-") and v[0].get("life", 0) > 0
    ]
    # The survivors' next commit of the step the fault broke (or a later one): a survivor
    # may still commit the step before it after the fault (the faulty replica was ahead).
    nexts = [
        min(e["t"] for e in v if e["event"] == "commit" and e["t"] > fault and e["step"] >= AT)
        for v in survivors
    ]
    rolled = sum(1 for v in survivors for e in v if e["event"] == "rollback" and e["t"] > fault)
    rejoin = [min(e["t"] for e in v if e["event"] == "commit") for v in restarted]
    steps = [
        b["t"] - a["t"]
        for v in survivors
        for a, b in zip(v, v[1:], strict=False)
        if a["event"] == b["event"] == "commit" and a["step"] >= 10 and b["step"] < AT
    ]
    return {
        "variant": variant,
        "fault": kind,
        "trial": trial,
        "next_commit_ms": round((max(nexts) - fault) * 1e3, 1),
        "steps_rolled_back": rolled,
        "rejoin_ms": round((min(rejoin) - fault) * 1e3, 1) if rejoin else None,
        "step_ms": round(statistics.median(steps) * 1e3, 2) if steps else None,
    }


def steady_pairs(pairs: int, steps: int, tmp: Path) -> dict[str, object]:
    """Fault-free step time, plain torchft vs ManagerFFT (both with torchft's default
    timeouts), in interleaved pairs: median step of the survivors' commits after warm-up."""
    out: dict[str, list[float]] = {"torchft default": [], "ManagerFFT": []}
    for i in range(pairs):
        for variant in out:
            mode, wflags, lflags = VARIANTS[variant]
            name = f"steady-{variant.replace(' ', '-')}-{i}"
            run = tmp / name
            hidden, layers = SIZES["small"]
            cmd = [sys.executable, "-m", "fastft.cli", "run", "--torchft", mode, "--nproc", "3"]
            cmd += ["--run-dir", str(run), "--job", name, *lflags]
            cmd += [WORKER, *wflags, "--steps", str(steps), "--hidden", str(hidden)]
            cmd += ["--layers", str(layers), "--out", str(run / "out")]
            env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"{name} failed: {(p.stdout + p.stderr)[-2000:]}")
            gaps = []
            for f in (run / "out").glob("replica*.jsonl"):
                v = [json.loads(line) for line in f.read_text().splitlines()]
                c = [e for e in v if e["event"] == "commit" and e["step"] >= steps // 4]
                gaps += [b["t"] - a["t"] for a, b in zip(c, c[1:], strict=False)]
            out[variant].append(statistics.median(gaps) * 1e3)
    ratios = sorted(f / t for t, f in zip(out["torchft default"], out["ManagerFFT"], strict=True))
    med = {k: round(statistics.median(v), 3) for k, v in out.items()}
    return {
        "pairs": pairs,
        "torchft_step_ms": med["torchft default"],
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
