"""Recovery and overhead, side by side in one run: 3 replicas (Gloo, CPU), an MLP of ~10k
and one of ~4M parameters.

* steady step time: plain DDP (``torch.distributed``, no fault tolerance: the floor) and
  fastft's transactional step on the same model and data; ratio and extra ms per step; and,
  as a reference, DDP with one more 1-element allreduce per step (what one agreement round
  per step costs here: fastft agrees on a COMMIT decision in the store every step);
* faults (SIGKILL, exception, SIGSTOP, a GIL-holding hang of one replica, mid-run) under
  ``fastft run --adaptive-hang``, in a
  fixed world (survivors wait for the restarted replica) and an elastic one
  (``--min-replicas 2``: survivors go on at once, the restarted replica rejoins): time from
  the fault to the survivors' next commit, steps rolled back, and the time until the
  restarted replica commits again; also a fixed world with a warm spare. Target: 50 ms +
  one step time (for the hang: + the adaptive hang timeout).

torchft runs side by side with fastft (native and ManagerFFT) in bench/torchft_recovery.py,
on this benchmark's models (fault trials on the 4M one with ``--fault-sizes large``).

    python bench/recovery.py [--trials 3] [--sizes small,large] [--quick]
    python bench/recovery.py --sizes large --faults none --repeats 0 --keep-pairs 3

``--keep-pairs N``: the fault-free cost of kept parts (an elastic world copies each step's
local gradient aside): elastic runs with and without ``--no-keep-gradients``, in turn.

Results: bench/results/recovery.json and two tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, table, write  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

HERE = Path(__file__).parent
WORKER = str(HERE / "_train.py")
NPROC = 3
SPARE_PREFAULT_MB = 192
"""The +spare worlds' spares prefault this much heap (``--spare-prefault-mb``; off by
default in ``fastft run``): what the README's table was measured with."""
FAULT_AFTER_S = 2.5
"""The fault hits a replica this long into training (at the start of that step, at least
step 20): a warm spare, started with the workers, has finished warming up by then (its
imports overlap theirs; ``spare_ready`` in the trial rows says whether it had). At step 20
of the 10.8k model (~0.1 s in) it often had not, and the +spare rows measured its
remaining warm-up instead of a recovery."""
WORLDS = ("fixed", "fixed+spare", "fixed+ahead", "elastic")
"""fixed: survivors wait for the restarted replica (a new Python process); fixed+spare: the
same with ``--warm-spares 1`` (a process with torch imported takes the lost rank);
fixed+ahead: the spare also runs the script up to ``fastft.init()`` before the fault
(``--spare-run-ahead``: the model and Adam are built ahead); elastic: ``--min-replicas 2``,
survivors go on at once and the replica rejoins later."""
SPARE_WORLDS = ("fixed+spare", "fixed+ahead")
"""Worlds with a warm spare; they sit near the target, so the large model runs ``--trials``
trials there too (one elsewhere: a cold restart is seconds over it, elastic well under)."""
SIZES = {  # name -> (hidden, layers)
    "small": (88, 2),  # 10,825 parameters
    "large": (1024, 5),  # 4,232,193 parameters
}


def n_params(hidden: int, layers: int) -> int:
    return 32 * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden + 1


def _env() -> dict[str, str]:
    return {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _step_times(out: Path, skip: int) -> list[float]:
    """Per-step wall time, the slowest rank's at each step (the job's step time)."""
    per_rank = [json.loads(f.read_text())["s"] for f in sorted(out.glob("steps-rank*.json"))]
    n = min(len(s) for s in per_rank)
    return [max(s[i] for s in per_rank) for i in range(skip, n)]


def _cpu_ms(out: Path) -> float | None:
    """CPU per step of all the workers together (each process's threads, after warm-up)."""
    per = [json.loads(f.read_text()).get("cpu_s_per_step") for f in out.glob("steps-rank*.json")]
    return round(sum(per) * 1e3, 3) if per and None not in per else None


def run_ddp(
    hidden: int, layers: int, steps: int, tmp: Path, *, extra_sync: bool = False
) -> list[float]:
    out = tmp / ("ddp-sync" if extra_sync else "ddp")
    port = _free_port()
    procs = []
    for r in range(NPROC):
        env = {
            **_env(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(NPROC),
        }
        cmd = [sys.executable, WORKER, "--mode", "ddp", "--steps", str(steps)]
        cmd += ["--hidden", str(hidden), "--layers", str(layers), "--out", str(out)]
        cmd += ["--extra-sync"] if extra_sync else []
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"DDP worker failed with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return _step_times(out, skip=10)


def run_fastft(
    hidden: int,
    layers: int,
    steps: int,
    tmp: Path,
    name: str,
    *,
    plan: list[dict[str, object]] | None = None,
    world: str = "fixed",
    flags: tuple[str, ...] = (),
    worker_args: list[str] | None = None,
) -> Path:
    run = tmp / name
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(NPROC)]
    cmd += ["--run-dir", str(run), "--job", name, "--adaptive-hang"]
    if world.startswith("elastic"):
        cmd += ["--min-replicas", str(NPROC - 1)]
    if world in SPARE_WORLDS:
        cmd += ["--warm-spares", "1", "--spare-prefault-mb", str(SPARE_PREFAULT_MB)]
    if world == "fixed+ahead":
        cmd += ["--spare-run-ahead"]
    cmd += flags
    if plan:
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += [WORKER, "--mode", "fastft", "--steps", str(steps)]
    cmd += ["--hidden", str(hidden), "--layers", str(layers), "--out", str(run / "out")]
    cmd += worker_args or []
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"fastft run {name} failed: {p.stderr[-2000:]}")
    return run


def steady(size: str, steps: int, repeats: int, tmp: Path) -> dict[str, object]:
    """DDP, fastft and DDP + one 1-element allreduce per step in turn, ``repeats`` rounds:
    the shared machine drifts, so the ratio is taken within each round and the median
    round reported."""
    hidden, layers = SIZES[size]
    pairs = []
    for i in range(repeats):
        d = tmp / size / f"r{i}"
        ddp = statistics.median(run_ddp(hidden, layers, steps, d))
        run = run_fastft(hidden, layers, steps, d, f"steady-{size}-{i}")
        fft = statistics.median(_step_times(run / "out", skip=10))
        sync = statistics.median(run_ddp(hidden, layers, steps, d, extra_sync=True))
        old = run_fastft(hidden, layers, steps, d, f"store-{size}-{i}", flags=("--decide", "store"))
        store = statistics.median(_step_times(old / "out", skip=10))
        cpu = (_cpu_ms(d / "ddp"), _cpu_ms(run / "out"))
        pairs.append((fft / ddp, ddp, fft, sync, cpu, store))
    ratio, ddp, fft, sync, _, store = sorted(pairs, key=lambda p: p[0])[len(pairs) // 2]
    ddp_cpu = [p[4][0] for p in pairs if p[4][0] is not None]
    fft_cpu = [p[4][1] for p in pairs if p[4][1] is not None]
    return {
        "model": size,
        "params": n_params(hidden, layers),
        "pairs": repeats,
        "ratio_range": f"{min(p[0] for p in pairs):.2f}-{max(p[0] for p in pairs):.2f}",
        "ddp_step_ms": round(ddp * 1e3, 3),
        "fastft_step_ms": round(fft * 1e3, 3),
        "ratio": round(ratio, 3),
        "extra_ms_per_step": round((fft - ddp) * 1e3, 3),
        # issue 65's targets: +0.3 ms a step at 10.8k parameters, 1.02x at 4.2M
        "target": "+0.3 ms" if size == "small" else "<= 1.02x",
        "met": (fft - ddp) * 1e3 <= 0.3 if size == "small" else ratio <= 1.02,
        # fastft deciding each step in the store (--decide store), in the same round
        "store_step_ms": round(store * 1e3, 3),
        "ddp_sync_step_ms": round(sync * 1e3, 3),
        "sync_extra_ms": round((sync - ddp) * 1e3, 3),
        # the workers' CPU per step (3 processes, every thread; not the store host),
        # median over the rounds
        "ddp_cpu_ms": round(statistics.median(ddp_cpu), 3) if ddp_cpu else None,
        "fastft_cpu_ms": round(statistics.median(fft_cpu), 3) if fft_cpu else None,
    }


def keep_cost(size: str, steps: int, pairs: int, tmp: Path) -> dict[str, object]:
    """Fault-free cost of kept parts: elastic runs with and without
    ``--no-keep-gradients`` in turn, ``pairs`` rounds (each round in another order);
    median step of each and the paired differences."""
    hidden, layers = SIZES[size]
    keep, bare = [], []
    for i in range(pairs):
        d = tmp / size / f"keep{i}"
        order = [True, False] if i % 2 == 0 else [False, True]
        for on in order:
            flags = () if on else ("--no-keep-gradients",)
            name = f"keep-{size}-{i}-{'on' if on else 'off'}"
            run = run_fastft(hidden, layers, steps, d, name, world="elastic", flags=flags)
            (keep if on else bare).append(statistics.median(_step_times(run / "out", skip=10)))
    diffs = sorted((k - b) * 1e3 for k, b in zip(keep, bare, strict=True))
    return {
        "model": size,
        "pairs": pairs,
        "keep_step_ms": round(statistics.median(keep) * 1e3, 3),
        "no_keep_step_ms": round(statistics.median(bare) * 1e3, 3),
        "paired_extra_ms": " ".join(f"{d:+.2f}" for d in diffs),
        "extra_pct_p50": round(statistics.median(diffs) / (statistics.median(bare) * 1e3) * 100, 2),
    }


def fault_trial(
    size: str, kind: str, world: str, step_s: float, trial: int, tmp: Path
) -> dict[str, object]:
    from fastft.report import summarize

    hidden, layers = SIZES[size]
    at = max(20, math.ceil(FAULT_AFTER_S / max(step_s, 1e-3)))
    # long enough after the fault for the restarted replica to start, heal and commit
    steps = at + max(40, math.ceil(12.0 / max(step_s, 1e-3)))
    name = f"{size}-{kind}-{world.replace('+', '-')}-{trial}"
    plan: list[dict[str, object]] = [{"kind": kind, "rank": 1 + trial % (NPROC - 1), "at_step": at}]
    if kind == "gil_hang":
        plan[0]["arg"] = 600  # holds the GIL until the agent kills it
    run = run_fastft(hidden, layers, steps, tmp / size, name, plan=plan, world=world)
    s = summarize(run)
    f = s["faults"][0]
    ev = read_events(run)
    hung = [e for e in ev if e["event"] == "worker_hung"]
    warm = [e for e in ev if e["event"] == "spawn" and e["warm"]]
    return {
        "model": size,
        "fault": kind,
        "world": world,
        "trial": trial,
        "detect_ms": f["detect_ms"],
        "next_commit_ms": f["recover_ms"],
        "steps_rolled_back": s["steps_rolled_back"],
        "rejoin_ms": f["rejoin_ms"],
        "step_ms": s["median_step_ms"],
        "faults_seen": len(s["faults"]),
        "hang_timeout_ms": round(hung[0]["timeout_s"] * 1e3, 1) if hung else None,
        # +spare: whether the spare that took the lost rank had finished warming up
        "spare_ready": warm[0]["spare_ready"] if warm else None,
    }


def _median(rows: list[dict[str, object]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r[key] is not None]  # type: ignore[arg-type]
    return round(statistics.median(vals), 1) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--faults", default="sigkill,exception,sigstop,gil_hang", help="or none")
    ap.add_argument("--steps", type=int, default=0, help="steady steps (default by size)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="DDP/fastft pairs for the ratio (0: skip)"
    )
    ap.add_argument("--quick", action="store_true", help="1 trial, small model only")
    ap.add_argument(
        "--keep-pairs",
        type=int,
        default=0,
        help="also time elastic fault-free runs with and without kept parts, N pairs",
    )
    a = ap.parse_args()
    sizes = ["small"] if a.quick else a.sizes.split(",")
    trials = 1 if a.quick else a.trials
    for s in sizes:
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r} (use {', '.join(SIZES)})")
    kinds = [] if a.faults == "none" else a.faults.split(",")
    if a.repeats == 0 and kinds:
        ap.error("--repeats 0 skips the steady rounds the fault targets need: add --faults none")
    tmp = Path(tempfile.mkdtemp(prefix="fastft-recovery-"))
    steady_rows, trial_rows, keep_rows = [], [], []
    items = sum(
        (1 if a.keep_pairs else 0)
        + (0 if a.repeats == 0 else 1)
        + (0 if a.repeats == 0 else sum(
            trials if size == "small" or w in SPARE_WORLDS else 1 for w in WORLDS
        ) * len(kinds))
        for size in sizes
    )  # fmt: skip
    progress = Progress("recovery", items)
    for size in sizes:
        steps = a.steps or (300 if size == "small" else 60)
        if a.keep_pairs:
            progress.next(f"{size}: kept parts, {a.keep_pairs} pairs")
            krow = keep_cost(size, max(steps, 80), a.keep_pairs, tmp)
            keep_rows.append(krow)
            print(f"kept parts {size}: {krow}", flush=True)
        if a.repeats == 0:
            continue
        progress.next(f"{size}: steady DDP/fastft pairs")
        row = steady(size, steps, 1 if a.quick else a.repeats, tmp)
        steady_rows.append(row)
        print(f"steady {size}: {row}", flush=True)
        step_s = float(row["fastft_step_ms"]) / 1e3  # type: ignore[arg-type]
        for kind in kinds:
            for world in WORLDS:
                for t in range(trials if size == "small" or world in SPARE_WORLDS else 1):
                    progress.next(f"{size}: {kind}, {world}, trial {t + 1}")
                    r = fault_trial(size, kind, world, step_s, t, tmp)
                    trial_rows.append(r)
                    print(f"  {r}", flush=True)
    progress.close()
    summary = []
    for size in [r["model"] for r in steady_rows]:
        step_ms = next(float(r["fastft_step_ms"]) for r in steady_rows if r["model"] == size)  # type: ignore[arg-type]
        for kind in kinds:
            for world in WORLDS:
                rows = [
                    r
                    for r in trial_rows
                    if r["model"] == size and r["fault"] == kind and r["world"] == world
                ]
                nxt = _median(rows, "next_commit_ms")
                # a true hang: the (adaptive) hang timeout + 50 ms + one step
                target = round(50 + step_ms + (_median(rows, "hang_timeout_ms") or 0.0), 1)
                summary.append(
                    {
                        "model": size,
                        "fault": kind,
                        "world": world,
                        "trials": len(rows),
                        "detect_p50_ms": _median(rows, "detect_ms"),
                        "next_commit_p50_ms": nxt,
                        "target_ms": target,
                        "met": "yes" if nxt is not None and nxt <= target else "no",
                        "rolled_back": _median(rows, "steps_rolled_back"),
                        "rejoin_p50_ms": _median(rows, "rejoin_ms"),
                    }
                )
    path = write(
        "recovery-quick" if a.quick else "recovery",
        summary,
        {
            "nproc": NPROC,
            "steady": steady_rows,
            "kept_parts": keep_rows,
            "trials": trial_rows,
            "torchft": "not run",
        },
    )
    if keep_rows:
        print()
        keys = ["model", "pairs", "keep_step_ms", "no_keep_step_ms", "paired_extra_ms"]
        print(table(keep_rows, [*keys, "extra_pct_p50"]))
    if steady_rows:
        print()
        print(
            table(
                steady_rows,
                [
                    "model",
                    "params",
                    "pairs",
                    "ddp_step_ms",
                    "fastft_step_ms",
                    "ratio",
                    "ratio_range",
                    "extra_ms_per_step",
                    "store_step_ms",
                    "ddp_sync_step_ms",
                    "sync_extra_ms",
                    "ddp_cpu_ms",
                    "fastft_cpu_ms",
                ],
            )
        )
    if not summary:
        print(f"\nresults: {path}")
        return
    print()
    print(
        table(
            summary,
            [
                "model",
                "fault",
                "world",
                "trials",
                "detect_p50_ms",
                "next_commit_p50_ms",
                "target_ms",
                "met",
                "rolled_back",
                "rejoin_p50_ms",
            ],
        )
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
