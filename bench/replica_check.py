"""What the in-band replica check costs (issue 47), side by side in one run:

1. per check, in process: the checksums of the 4.2M-parameter MLP's whole state
   (parameters, buffers, Adam's state and settings), against a SHA-256 of the same bytes
   (what the offline ``--check-every`` digest costs); and the copy of the state a checked
   step begins with, kept as the last verified state once its check passes (what a
   mismatch's repair goes back to, issue 61), with the memory the copies hold;
2. per fault-free step of that model under ``fastft run`` (3 Gloo workers, the job secret
   on, the worker's real connections): ``--compare-every`` 0 (off), 20 and the default
   (40), interleaved runs, medians of the median step time. The check adds at
   most one small allreduce per checked step (none where the step's own agreement
   allreduce runs anyway, as with ``fastft.Batches`` or ``--decide collective``).

Target: the default cadence costs <= 1 % of the step. Results:
bench/results/replica_check.json and a table.

    python bench/replica_check.py [--steps 120] [--pairs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402

from fastft.demo.train import build  # noqa: E402
from fastft.runtime.state.compare import checksums, replica_items  # noqa: E402
from fastft.runtime.state.registry import StateRegistry  # noqa: E402
from fastft.runtime.state.wire import _bytes  # noqa: E402

CHECKS: list[float] = []
"""Every check's own wall time in the workers (its ``replica_check`` events), in ms."""
HIDDEN, LAYERS = 1024, 5  # 4,232,193 parameters (bench/recovery.py's large model)


def per_check(repeats: int) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    model = build(HIDDEN, 0, LAYERS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).sum().backward()
    opt.step()  # (Adam's two moments exist)
    r = StateRegistry()
    r.register(model=model, optimizer=opt)
    r.begin_step()
    params = sum(p.numel() for p in model.parameters())
    items = replica_items(r, replicated=True)
    rows = []
    for name, fn in (
        ("checksums (the replica check)", lambda: checksums(replica_items(r, replicated=True))),
        ("sha256 (the --check-every digest)", lambda: _sha(items)),
        ("the verified copy (as a checked step begins)", lambda: r.verified.hold(r, 0)),
    ):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rows.append(
            {"what": name, "params": params, "ms_per_check": statistics.median(times) * 1e3}
        )
    return rows


def verified_mb() -> float:
    """The memory the verified state holds at most: two copies of the whole state (the
    verified one, and the one a check compares until it passes)."""
    from fastft.runtime.state.wire import _tensors

    model = build(HIDDEN, 0, LAYERS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    r = StateRegistry()
    r.register(model=model, optimizer=opt)
    one = sum(t.numel() * t.element_size() for t in _tensors(r.state(0)))
    return 2 * one / 2**20


def _sha(items: list) -> str:
    from fastft.runtime.state.wire import _tensors

    h = hashlib.sha256()
    for _, state in items:
        for t in _tensors(state):
            h.update(_bytes(t))
    return h.hexdigest()


def step_times(run: Path, every: int) -> tuple[float, float | None, float | None]:
    """(the median step, the median of the steps that ran the check, of those that did
    not) in ms, from every rank's commits: within one run, the same workers."""
    from fastft.runtime import read_events

    by_rank: dict[str, list[tuple[int, float]]] = {}
    for e in read_events(run):
        if e["event"] == "commit":
            by_rank.setdefault(e["src"], []).append((e["step"], e["mono"]))
    checked: list[float] = []
    plain: list[float] = []
    CHECKS.extend(e["ms"] for e in read_events(run) if e["event"] == "replica_check")
    for commits in by_rank.values():
        for (_, a), (step, b) in zip(commits, commits[1:], strict=False):
            if step < 10:
                continue  # (warm-up, and the epoch's first steps, checked by rule)
            (checked if every and step % every == 0 else plain).append((b - a) * 1e3)
    every_step = checked + plain
    return (
        statistics.median(every_step),
        statistics.median(checked) if checked else None,
        statistics.median(plain) if plain else None,
    )


def per_step(tmp: Path, every: int, steps: int, i: int) -> tuple[float, float | None, float | None]:
    run = tmp / f"every{every}-{i}"
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)),
        *("--job", run.name, "--compare-every", str(every)),
        *("-m", "fastft.demo.train", "--", "--steps", str(steps)),
        *("--hidden", str(HIDDEN), "--layers", str(LAYERS)),
    ]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=1800)
    return step_times(run, every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--cadences", type=int, nargs="+", default=[0, 20, 40])
    a = ap.parse_args()
    check_rows = per_check(a.repeats)
    times: dict[int, list[tuple[float, float | None, float | None]]] = {c: [] for c in a.cadences}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.pairs):  # interleaved, the order turned every other round
            for every in a.cadences if i % 2 == 0 else reversed(a.cadences):
                times[every].append(per_step(Path(d), every, a.steps, i))
    off = statistics.median(t[0] for t in times[0]) if 0 in times else None
    step_rows: list[dict[str, object]] = []
    added: dict[int, float] = {}
    for every in a.cadences:
        med = statistics.median(t[0] for t in times[every])
        pairs = [(c, p) for _, c, p in times[every] if c is not None and p is not None]
        if pairs:  # within each run: a checked step against the run's unchecked ones
            added[every] = statistics.median(c - p for c, p in pairs)
        step_rows.append(
            {
                "compare_every": every,
                "median_step_ms": med,
                "vs_off_pct": 100 * (med / off - 1) if off else 0.0,
                "checked_step_added_ms": added.get(every, 0.0),
                "all_ms": " ".join(f"{t[0]:.2f}" for t in times[every]),
            }
        )
    check_ms = float(check_rows[0]["ms_per_check"])  # type: ignore[arg-type]
    copy_ms = float(check_rows[2]["ms_per_check"])  # type: ignore[arg-type]
    # The default cadence's cost: what a checked step adds within the same run (the same
    # workers, minutes apart at most), amortized over the cadence, against the step. The
    # runs' medians drift by more than that between runs on this shared machine.
    default = 40
    per_step_ms = added.get(default, 0.0) / default
    meta = {
        "check_compute_ms": check_ms,
        "verified_copy_ms": copy_ms,
        "verified_copies_mb": verified_mb(),
        "check_in_worker_ms_p50": statistics.median(CHECKS) if CHECKS else None,
        "step_ms_off": off,
        "default_cadence": default,
        "checked_step_added_ms": added.get(default),
        "cost_pct_of_step_at_default": 100 * per_step_ms / off if off else None,
    }
    path = write("replica_check", [*check_rows, *step_rows], meta)
    print(table(check_rows, ["what", "params", "ms_per_check"]))
    print()
    cols = ["compare_every", "median_step_ms", "vs_off_pct", "checked_step_added_ms", "all_ms"]
    print(table(step_rows, cols))
    print()
    for k, v in meta.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
