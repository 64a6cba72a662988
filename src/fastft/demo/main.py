"""``fastft demo``: a fault-free run and a run with one fault of each kind (an exception,
a SIGKILL, a SIGSTOP hang, rank 0 killed), same seed, 4 workers (Gloo on CPU by default;
``--device cuda`` trains on the GPUs); then the table of what happened and the equivalence
check (S5: equal final state). Exits 1 if the check fails or a fault was not recovered."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from fastft.process.rundir import default_run_dir
from fastft.report import render_report, summarize

__all__ = ["run_demo"]


def _plan(steps: int, nproc: int = 4) -> list[dict[str, object]]:
    """One fault of each kind, the last on rank 0; with fewer than 4 workers some rank
    gets two."""
    q = max(4, steps // 5)
    plan: list[dict[str, object]] = []
    lives: dict[int, int] = {}  # a rank's life after its earlier faults (a kill ends one)
    for i, (kind, rank) in enumerate(
        [("exception", 1 % nproc), ("sigkill", 2 % nproc), ("sigstop", 3 % nproc), ("sigkill", 0)]
    ):
        plan.append(
            {"kind": kind, "rank": rank, "at_step": (i + 1) * q, "life": lives.get(rank, 0)}
        )
        if kind != "exception":
            lives[rank] = lives.get(rank, 0) + 1
    return plan


def _run(
    run: Path,
    nproc: int,
    steps: int,
    plan: list[dict[str, object]] | None,
    live: bool = False,
    flags: tuple[str, ...] = (),
    train: tuple[str, ...] = (),
    script: str = "fastft.demo.train",
) -> int:
    cmd = [
        sys.executable,
        "-m",
        "fastft.cli",
        "run",
        "--nproc",
        str(nproc),
        "--run-dir",
        str(run),
        "--job",
        run.name,
        "--check-every",
        "10",
        *flags,
    ]
    if plan:
        run.mkdir(parents=True, exist_ok=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += ["-m", script, "--", "--steps", str(steps), "--out", str(run / "out")]
    cmd += train
    if not live:
        return subprocess.run(cmd, timeout=600).returncode
    from fastft.demo.live import follow

    with open(run.parent / f"{run.name}.log", "w") as log:  # the launcher's own lines
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            return follow(run, f"{run.name}: {nproc} workers, {steps} steps", proc)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


def _digests(run: Path) -> set[str]:
    return {json.loads(f.read_text())["digest"] for f in (run / "out").glob("final-rank*.json")}


def _max_param_diff(a: Path, b: Path) -> float:
    import torch

    worst = 0.0
    if any((a / "out").glob("final-rank*.npy")):  # (the JAX demo's: one flat array)
        import numpy as np

        base = np.load(next((a / "out").glob("final-rank*.npy")))
        for f in (b / "out").glob("final-rank*.npy"):
            worst = max(worst, float(np.abs(np.load(f) - base).max()))
        return worst
    ref = torch.load(next((a / "out").glob("final-rank*.pt")), weights_only=True)
    for f in (b / "out").glob("final-rank*.pt"):
        got = torch.load(f, weights_only=True)
        for k, v in ref.items():
            worst = max(worst, float((got[k] - v).abs().max()))
    return worst


def _samples_once(run: Path) -> bool:
    from fastft.report import shards_by_step, untiled_steps
    from fastft.runtime import read_events

    shards = shards_by_step(read_events(run))
    return bool(shards) and not untiled_steps(shards)


def run_demo(
    steps: int = 200,
    nproc: int = 4,
    run_dir: str | None = None,
    live: bool = False,
    elastic: bool = False,
    device: str = "cpu",
    extra_flags: tuple[str, ...] = (),
    framework: str = "torch",
) -> int:
    """``extra_flags``: more ``fastft run`` flags for the run with faults (benchmarks).
    ``framework``: ``jax`` trains the same model with JAX (``fastft.demo.train_jax``)."""
    jax = framework == "jax"
    script = "fastft.demo.train_jax" if jax else "fastft.demo.train"
    root = Path(run_dir) if run_dir else default_run_dir("demo")
    live = live and sys.stdout.isatty()  # a live display only on a terminal
    mode = f"elastic (--min-replicas {max(1, nproc // 2)})" if elastic else "fixed world"
    print(
        f"fastft demo{' (JAX)' if jax else ''}: {nproc} workers on {device}, {steps} steps, "
        f"{mode}, runs in {root}",
        flush=True,
    )
    # elastic: slower steps, so that restarted workers (~2 s of start-up) get back in
    train: tuple[str, ...] = ("--step-time", "0.03") if elastic else ()
    train += () if jax else ("--device", device)
    # warm spares: a killed worker's place is taken by a process with torch imported
    flags: tuple[str, ...] = ("--warm-spares", str(min(3, nproc)), *extra_flags)
    if elastic:
        flags += ("--min-replicas", str(max(1, nproc // 2)))
    t0 = time.monotonic()
    print("1/2 fault-free run ...", flush=True)
    if _run(root / "clean", nproc, steps, None, live, train=train, script=script) != 0:
        print("fault-free run failed", file=sys.stderr)
        return 1
    print(f"2/2 run with faults: {json.dumps(_plan(steps, nproc))}", flush=True)
    code = _run(root / "faulty", nproc, steps, _plan(steps, nproc), live, flags, train, script)
    figures = summarize(root / "faulty")
    print()
    print(render_report(root / "faulty", figures))
    print(LEGEND)
    recovered = all(f["recovered"] for f in figures["faults"]) and len(figures["faults"]) >= 4
    print()
    if elastic:
        diff = _max_param_diff(root / "clean", root / "faulty") if code == 0 else float("inf")
        once = code == 0 and _samples_once(root / "faulty")
        equal = once and diff <= 1e-4
        print(f"every sample of every committed step consumed once: {'yes' if once else 'NO'}")
        print(f"largest parameter difference to the fault-free run: {diff:.3g}")
    else:
        clean, faulty = _digests(root / "clean"), _digests(root / "faulty")
        equal = code == 0 and len(clean) == 1 and clean == faulty
        print(f"final state digest, fault-free: {sorted(clean)}  with faults: {sorted(faulty)}")
    print(
        f"S5 equivalence (the run with faults ends "
        f"{'as the fault-free one' if elastic else 'bitwise equal to the fault-free one'}): "
        f"{'HOLDS' if equal else 'FAILED'}; every fault recovered: "
        f"{'yes' if recovered else 'NO'}; {time.monotonic() - t0:.0f} s"
    )
    print(
        "\nNext: wrap your own training loop (README, 'Wrapping a training loop'), then\n"
        f"  fastft run --nproc 4 train.py\n"
        f"and see this run's timeline: fastft report {root / 'faulty'} --plot timeline.png"
    )
    return 0 if equal and recovered else 1


LEGEND = """
Each row is one fault, its times from the moment it happened: detected, when the first
other worker was interrupted; survivors' next commit, when they committed a step again
(training goes on); restarted worker committing, when the replaced worker committed
again (a warm spare, or a restart that healed its state from a peer). Last line: epochs
count the memberships (one more per recovery), heals the state transfers (the first
start's included), goodput the committed steps x the median step over the run's time."""
