"""What the in-band replica check costs (issue 47), side by side in one run:

1. per check, in process: the checksums of the 4.2M-parameter MLP's whole state
   (parameters, buffers, Adam's state and settings), against a SHA-256 of the same bytes
   (what the offline ``--check-every`` digest costs);
2. per fault-free step of that model under ``fastft run`` (3 Gloo workers, the job secret
   on, the worker's real connections): ``--compare-every`` 0 (off), the default (10) and
   1 (every step), interleaved runs, medians of the median step time. The check adds at
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
from fastft.runtime.state.compare import checksums  # noqa: E402
from fastft.runtime.state.registry import StateRegistry  # noqa: E402
from fastft.runtime.state.wire import _bytes  # noqa: E402

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
    items = r.replica_items(replicated=True)
    rows = []
    for name, fn in (
        ("checksums (the replica check)", lambda: checksums(r.replica_items(replicated=True))),
        ("sha256 (the --check-every digest)", lambda: _sha(items)),
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


def _sha(items: list) -> str:
    from fastft.runtime.state.wire import _tensors

    h = hashlib.sha256()
    for _, state in items:
        for t in _tensors(state):
            h.update(_bytes(t))
    return h.hexdigest()


def per_step(tmp: Path, every: int, steps: int, i: int) -> float:
    run = tmp / f"every{every}-{i}"
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)),
        *("--job", run.name, "--compare-every", str(every)),
        *("-m", "fastft.demo.train", "--", "--steps", str(steps)),
        *("--hidden", str(HIDDEN), "--layers", str(LAYERS)),
    ]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=1800)
    from fastft.report import summarize

    return float(summarize(run)["median_step_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--cadences", type=int, nargs="+", default=[0, 10, 1])
    a = ap.parse_args()
    check_rows = per_check(a.repeats)
    times: dict[int, list[float]] = {c: [] for c in a.cadences}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.pairs):  # interleaved, the order turned every other round
            for every in a.cadences if i % 2 == 0 else reversed(a.cadences):
                times[every].append(per_step(Path(d), every, a.steps, i))
    off = statistics.median(times[0]) if 0 in times else None
    step_rows: list[dict[str, object]] = []
    for every in a.cadences:
        med = statistics.median(times[every])
        step_rows.append(
            {
                "compare_every": every,
                "median_step_ms": med,
                "vs_off_pct": 100 * (med / off - 1) if off else 0.0,
                "all_ms": " ".join(f"{t:.2f}" for t in times[every]),
            }
        )
    check_ms = float(check_rows[0]["ms_per_check"])  # type: ignore[arg-type]
    # the check's own cost at the default cadence, from its measured parts: its compute,
    # amortized, against the step (the timed runs' differences are within their noise)
    default = next((r for r in step_rows if r["compare_every"] == 10), None)
    meta = {
        "check_ms": check_ms,
        "step_ms_off": off,
        "default_cadence": 10,
        "check_compute_pct_of_step_at_default": 100 * check_ms / 10 / off if off else None,
        "measured_pct_at_default": default["vs_off_pct"] if default else None,
    }
    path = write("replica_check", [*check_rows, *step_rows], meta)
    print(table(check_rows, ["what", "params", "ms_per_check"]))
    print()
    print(table(step_rows, ["compare_every", "median_step_ms", "vs_off_pct", "all_ms"]))
    print()
    for k, v in meta.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
