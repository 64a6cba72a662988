"""torchft with and without fastft's error bus, side by side in one run, 3 Gloo replicas,
one fault schedule, on the models of bench/recovery.py:

* ``torchft default``: torchft's ``Manager`` and lighthouse with their default timeouts
  (Gloo 60 s, Manager 30 s, lighthouse heartbeat 5 s, join 60 s); the node agent only
  restarts a replica that exits (as torchrun would);
* ``torchft tuned``: timeouts a production job could afford (lighthouse heartbeat 1 s,
  ten of torchft's 100 ms beats; join 1 s; Gloo and Manager 10 s, room for a large
  model's collectives);
* ``torchft lowest``: the lowest setting at which torchft still runs here (heartbeat
  100 ms, join 100 ms, Gloo 0.25 s, Manager 1 s), far below what a production job affords;
* ``ManagerFFT``: the same script with ``ManagerFFT`` and torchft's *default* timeouts,
  under ``fastft run --torchft fastft`` (BusLighthouse), quorum leases on (its default);
* ``fastft native``: fastft's own runtime on the same model (elastic world, cold restart).

Faults, on the ~10k-parameter model (``--fault-sizes small,large`` adds the 4M one):
SIGKILL, exception, SIGSTOP and a GIL-holding hang of replica 1 as its gradient allreduce
starts (its peers are inside it): time from the fault to the moment both survivors
committed again, steps rolled back, and time until the restarted replica commits again
(each run has one warm spare).

Fault-free, on both models (``--steady-sizes``): plain torchft, plain torchft on
BusLighthouse, ManagerFFT asking for a quorum every step (``quorum_every=1``: these two
split ManagerFFT's own cost from the Python lighthouse's and from the leases') and
ManagerFFT in interleaved runs, each round in another order: the median step after warm-up, and the CPU
per step of the workers and of the control plane (agent and lighthouse process), sampled
over the same window. The median step before the fault of each fault run is reported too.

The GIL hang is run for ManagerFFT (``--adaptive-hang``) and fastft native only: under
plain torchft the hung replica's Rust heartbeat thread keeps beating, so the survivors wait
for Gloo's timeout (60 s default) and then for the lighthouse's join timeout (60 s).

    python bench/torchft_recovery.py [--trials 3] [--faults sigkill,exception,sigstop]

Results: bench/results/torchft_recovery.json and a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, table, write  # noqa: E402
from recovery import SIZES, run_fastft  # noqa: E402

from fastft.report import summarize  # noqa: E402

HERE = Path(__file__).parent
WORKER = str(HERE / "_torchft_train.py")
AT = 40
STEPS = {"small": 220, "large": 150}
NATIVE_STEPS = {"small": 2000, "large": 150}
"""Native runs: the cold-restarted replica (2-3 s) must arrive before the end (~5 ms steps
at 10k parameters, ~65 ms at 4M)."""
VARIANTS = {  # name -> (fastft run --torchft, worker flags, lighthouse flags)
    "torchft default": ("plain", ["--manager", "plain"], []),
    "torchft tuned": (
        "plain",
        ["--manager", "plain", "--pg-timeout", "10", "--timeout", "10"],
        ["--lighthouse-heartbeat-ms", "1000", "--lighthouse-join-ms", "1000"],
    ),
    "torchft lowest": (
        "plain",
        ["--manager", "plain", "--pg-timeout", "0.25", "--timeout", "1"],
        ["--lighthouse-heartbeat-ms", "100", "--lighthouse-join-ms", "100"],
    ),
    "ManagerFFT": ("fastft", ["--manager", "fft"], []),
}


STEADY = {  # fault-free rounds; the middle two split ManagerFFT's cost from the lighthouse's
    "torchft default": VARIANTS["torchft default"],
    "torchft + BusLighthouse": ("fastft", ["--manager", "plain"], []),
    "ManagerFFT, a quorum every step": ("fastft", ["--manager", "fft", "--quorum-every", "1"], []),
    "ManagerFFT": VARIANTS["ManagerFFT"],
}


def run_replicas(
    variant: tuple[str, list[str], list[str]],
    run: Path,
    steps: int,
    *flags: str,
    env: dict[str, str] | None = None,
    size: str = "small",
    cpu: list[tuple[float, dict[str, float]]] | None = None,
) -> dict[str, list[dict]]:
    """``fastft run --torchft`` 3 replicas of the worker; each replica life's log by name
    (``replica<group>-<pid>``). With ``cpu``, appends (CLOCK_MONOTONIC, CPU seconds so far
    of the agent, the lighthouse process and the workers) every 0.1 s."""
    mode, wflags, lflags = variant
    hidden, layers = SIZES[size]
    run.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--torchft", mode, "--nproc", "3"]
    cmd += ["--run-dir", str(run), "--job", run.name, *lflags, *flags]
    cmd += [WORKER, *wflags, "--steps", str(steps), "--hidden", str(hidden)]
    cmd += ["--layers", str(layers), "--out", str(run / "out")]
    env = {**os.environ, **(env or {}), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    with open(run / "launcher.log", "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if cpu is not None:
                sample_cpu(p, cpu)
            p.wait(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    if p.returncode != 0:
        raise RuntimeError(f"{run.name} failed: {(run / 'launcher.log').read_text()[-2000:]}")
    return {
        f.stem: [json.loads(line) for line in f.read_text().splitlines()]
        for f in (run / "out").glob("replica*.jsonl")
    }


def sample_cpu(p: subprocess.Popen[bytes], out: list[tuple[float, dict[str, float]]]) -> None:
    """Until ``p`` ends: CPU seconds (user + system) of its process tree by role."""
    root = psutil.Process(p.pid)
    last: dict[int, tuple[str, float]] = {}
    deadline = time.monotonic() + 600  # as run_replicas' wait
    while p.poll() is None and time.monotonic() < deadline:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for proc in procs:
            try:
                line = " ".join(proc.cmdline())
                t = proc.cpu_times()
            except psutil.Error:
                continue
            role = (
                "agent"
                if proc.pid == p.pid
                else "lighthouse"
                if "torchft.lighthouse" in line
                else "workers"
            )
            last[proc.pid] = (role, t.user + t.system)
        now = time.monotonic()
        roles = {"agent": 0.0, "lighthouse": 0.0, "workers": 0.0}
        for role, c in last.values():
            roles[role] += c
        out.append((now, roles))
        time.sleep(0.1)


def commit_gaps(log: list[dict], lo: int, hi: int) -> list[float]:
    """Seconds between consecutive commits of steps lo..hi-1 in one replica's log."""
    return [
        b["t"] - a["t"]
        for a, b in zip(log, log[1:], strict=False)
        if a["event"] == b["event"] == "commit" and a["step"] >= lo and b["step"] < hi
    ]


def torchft_trial(
    variant: str, kind: str, trial: int, tmp: Path, size: str = "small"
) -> dict[str, object]:
    run = tmp / f"{variant.replace(' ', '-')}-{size}-{kind}-{trial}"
    run.mkdir(parents=True)
    fault: dict[str, object] = {"kind": kind, "rank": 1, "at_step": AT, "point": "collective"}
    if kind == "gil_hang":
        fault["arg"] = 600  # holds the GIL until the agent kills it
    (run / "plan.json").write_text(json.dumps({"faults": [fault]}))
    flags = ["--warm-spares", "1"]
    if VARIANTS[variant][0] == "fastft":
        flags += ["--adaptive-hang"]
    logs = run_replicas(
        VARIANTS[variant],
        run,
        STEPS[size],
        *flags,
        env={"BENCH_PLAN": str(run / "plan.json")},
        size=size,
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
        "size": size,
        "variant": variant,
        "fault": kind,
        "trial": trial,
        "next_commit_ms": round((max(nexts) - t_fault) * 1e3, 1),
        "steps_rolled_back": rolled,
        "rejoin_ms": round((min(rejoin) - t_fault) * 1e3, 1) if rejoin else None,
        "step_ms": round(statistics.median(steps) * 1e3, 2) if steps else None,
    }


def steady_pairs(pairs: int, steps: int, size: str, tmp: Path) -> dict[str, object]:
    """Fault-free step time in interleaved rounds of :data:`STEADY` (torchft's default
    timeouts everywhere): median gap between commits after warm-up, and CPU per step of
    the workers (3 replicas together) and of the control plane (agent and lighthouse;
    plain torchft's lighthouse runs inside the agent), measured over the same window."""
    out: dict[str, list[float]] = {v: [] for v in STEADY}
    cpu_out: dict[str, list[dict[str, float]]] = {v: [] for v in STEADY}
    names = list(STEADY)
    for i in range(pairs):
        k = i % len(names)
        for name in names[k:] + names[:k]:  # each round starts with another
            variant = STEADY[name]
            samples: list[tuple[float, dict[str, float]]] = []
            slug = "".join(c if c.isalnum() else "-" for c in name)
            run = tmp / f"steady-{size}-{slug}-{i}"
            logs = run_replicas(variant, run, steps, size=size, cpu=samples)
            gaps = [g for v in logs.values() for g in commit_gaps(v, steps // 4, steps)]
            out[name].append(statistics.median(gaps) * 1e3)
            cpu_out[name].append(cpu_per_step(logs, samples, steps // 4))
    ratios = sorted(f / t for t, f in zip(out["torchft default"], out["ManagerFFT"], strict=True))
    med = {k: round(statistics.median(v), 3) for k, v in out.items()}

    def cpu(name: str, role: str) -> float:
        return round(statistics.median(c[role] for c in cpu_out[name]), 3)

    return {
        "size": size,
        "pairs": pairs,
        "torchft_step_ms": med["torchft default"],
        "torchft_buslighthouse_step_ms": med["torchft + BusLighthouse"],
        "managerfft_every_step_ms": med["ManagerFFT, a quorum every step"],
        "managerfft_step_ms": med["ManagerFFT"],
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": f"{ratios[0]:.3f}-{ratios[-1]:.3f}",
        "torchft_control_cpu_ms": cpu("torchft default", "control"),
        "managerfft_control_cpu_ms": cpu("ManagerFFT", "control"),
        "torchft_worker_cpu_ms": cpu("torchft default", "workers"),
        "buslighthouse_worker_cpu_ms": cpu("torchft + BusLighthouse", "workers"),
        "managerfft_worker_cpu_ms": cpu("ManagerFFT", "workers"),
    }


def cpu_per_step(
    logs: dict[str, list[dict]], samples: list[tuple[float, dict[str, float]]], lo: int
) -> dict[str, float]:
    """CPU milliseconds per committed step, from the first sample after every replica
    committed step ``lo`` to the last sample before the first replica finished."""
    start = max(
        e["t"] for v in logs.values() for e in v if e["event"] == "commit" and e["step"] == lo
    )
    end = min(max(e["t"] for e in v if e["event"] == "commit") for v in logs.values())
    window = [(t, c) for t, c in samples if start <= t <= end]
    if len(window) < 2:
        return {"control": float("nan"), "workers": float("nan")}
    (t0, c0), (t1, c1) = window[0], window[-1]
    some = next(iter(logs.values()))
    n = sum(1 for e in some if e["event"] == "commit" and t0 < e["t"] <= t1)
    control = (c1["agent"] + c1["lighthouse"]) - (c0["agent"] + c0["lighthouse"])
    return {"control": control / n * 1e3, "workers": (c1["workers"] - c0["workers"]) / n * 1e3}


def native_trial(kind: str, trial: int, tmp: Path, size: str = "small") -> dict[str, object]:
    hidden, layers = SIZES[size]
    plan: list[dict[str, object]] = [
        {"kind": kind, "rank": 1, "at_step": AT, "point": "collective"}
    ]
    if kind == "gil_hang":
        plan[0]["arg"] = 600
    name = f"native-{size}-{kind}-{trial}"
    run = run_fastft(hidden, layers, NATIVE_STEPS[size], tmp, name, plan=plan, world="elastic")
    s = summarize(run)
    f = s["faults"][0]
    return {
        "size": size,
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
    ap.add_argument("--steady-steps", type=int, default=400, help="per run, small model")
    ap.add_argument("--steady-sizes", default="small,large", help="models of bench/recovery.py")
    ap.add_argument("--fault-sizes", default="small", help="models for the fault trials")
    a = ap.parse_args()
    steady: list[dict[str, object]] = []
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="fastft-torchft-bench-") as d:
        tmp = Path(d)
        sizes = a.steady_sizes.split(",") if a.steady_pairs else []
        trials = [
            (size, trial, kind, variant)
            for size, trial, kind, variant in itertools.product(
                a.fault_sizes.split(","),
                range(a.trials),
                a.faults.split(","),
                a.variants.split(","),
            )
            if not (kind == "gil_hang" and variant.startswith("torchft"))  # see the docstring
        ]
        progress = Progress("torchft_recovery", len(sizes) + len(trials))
        for size in sizes:
            progress.next(f"{size}: {a.steady_pairs} steady pairs")
            # ~130 ms steps at 4M parameters: fewer steps give the same warm-up share
            steps = a.steady_steps if size == "small" else max(40, a.steady_steps // 4)
            steady.append(steady_pairs(a.steady_pairs, steps, size, tmp))
            print(json.dumps(steady[-1]), flush=True)
        for size, trial, kind, variant in trials:
            progress.next(f"{variant}: {kind}, {size}, trial {trial + 1}")
            if variant == "fastft native":
                row = native_trial(kind, trial, tmp, size)
            else:
                row = torchft_trial(variant, kind, trial, tmp, size)
            rows.append(row)
            print(json.dumps(row), flush=True)
        progress.close()
    summary: list[dict[str, object]] = []
    for size, variant, kind in itertools.product(
        a.fault_sizes.split(","), a.variants.split(","), a.faults.split(",")
    ):
        base = [
            float(r["step_ms"])  # type: ignore[arg-type]
            for r in rows
            if r["variant"] == "torchft default" and r["size"] == size and r["step_ms"]
        ]
        base_step = statistics.median(base or [float("nan")])
        rs = [
            r for r in rows if r["variant"] == variant and r["fault"] == kind and r["size"] == size
        ]
        if not rs:
            continue

        def med(key: str, rs: list[dict[str, object]] = rs) -> float | None:
            vals = [float(r[key]) for r in rs if r[key] is not None]  # type: ignore[arg-type]
            return round(statistics.median(vals), 1) if vals else None

        step = med("step_ms")
        summary.append(
            {
                "size": size,
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
    if summary:
        print(table(summary, list(summary[0])))
    if steady:
        print(table(steady, list(steady[0])))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
