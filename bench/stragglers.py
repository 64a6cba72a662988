"""Stragglers (issue 50), side by side in one run: 4 Gloo workers training the demo under
``fastft run`` (the job secret on, a warm spare), one of them 1.5x slower from step 20 on
(the ``slow`` fault, in its first life only: a throttled device that a new process on a
spare does not share), under ``--stragglers off`` (no detection: what every peer's
default does), ``report`` (fastft's default) and ``replace``.

Measured from each run's events: the committed steps per second after the slowdown began
against the fault-free run's; the steps from the slowdown to the straggler's naming; with
``replace``, the rate once the replacement committed. And the fault-free step with
detection (``report``) against without (``off``): interleaved pairs, the median of each
run's median step time (target: at most 1 %).

Targets: named within 10 steps (its compute is the median of its last 10) plus the check
period (0.5 s); with ``replace``, the step rate back within 5 % of fault-free.

    python bench/stragglers.py [--steps 300] [--pairs 5] [--factor 1.5]
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
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, table, write  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

SLOW_AT = 20


def run(out: Path, name: str, mode: str, a: argparse.Namespace, slow: bool) -> Path:
    """One job; its run directory."""
    d = out / name
    d.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "4", "--warm-spares", "1"]
    cmd += ["--run-dir", str(d), "--job", name, "--stragglers", mode]
    if slow:
        plan = {"faults": [{"kind": "slow", "rank": 1, "at_step": SLOW_AT, "arg": a.factor}]}
        (d / "plan.json").write_text(json.dumps(plan))
        cmd += ["--inject", str(d / "plan.json")]
    cmd += ["-m", "fastft.demo.train", "--", "--steps", str(a.steps), "--out", str(d / "out")]
    cmd += ["--step-time", str(a.step_time)]
    with open(d / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{name}: exit status {p.returncode}; see {d / 'launcher.log'}")
    return d


def commits(d: Path) -> dict[int, float]:
    """Step -> when it was first committed (any member)."""
    got: dict[int, float] = {}
    for e in read_events(d):
        if e["event"] == "commit":
            got[e["step"]] = min(got.get(e["step"], e["mono"]), e["mono"])
    return got


def rate(c: dict[int, float], first: int, last: int) -> float:
    """Committed steps per second from step ``first`` to ``last``."""
    return (last - first) / (c[last] - c[first])


def median_step_ms(d: Path) -> float:
    c = commits(d)
    steps = sorted(c)
    return (
        statistics.median(c[b] - c[a] for a, b in zip(steps[10:-1], steps[11:], strict=True)) * 1e3
    )


def judged(d: Path, a: argparse.Namespace, free: float) -> dict[str, Any]:
    """One slowed run's figures."""
    ev = read_events(d)
    c = commits(d)
    last = max(c)
    named = [e for e in ev if e["event"] == "straggler"]
    at = max((s for s, t in c.items() if named and t <= named[0]["mono"]), default=None)
    row: dict[str, Any] = {
        "named_after_steps": None if at is None else at - SLOW_AT,
        "ratio_named": named[0]["ratio"] if named else None,
        "rate_after_slowdown": round(rate(c, SLOW_AT, last), 2),
        "vs_fault_free": round(rate(c, SLOW_AT, last) / free, 3),
    }
    spawned = [e["mono"] for e in ev if e["event"] == "spawn" and e["rank"] == 1 and e["life"]]
    back = [
        e["mono"] for e in ev
        if e["event"] == "commit" and e["src"] == "rank 1" and spawned and e["mono"] > spawned[0]
    ]  # fmt: skip
    if back:  # the replacement's first commit: the rate from there on
        first = max(s for s, t in c.items() if t <= back[0])
        if last - first >= 20:
            row["rate_replaced"] = round(rate(c, first, last), 2)
            row["replaced_vs_fault_free"] = round(row["rate_replaced"] / free, 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=5, help="fault-free off/report pairs")
    ap.add_argument("--factor", type=float, default=1.5, help="the straggler's slowdown")
    ap.add_argument("--step-time", type=float, default=0.03)
    a = ap.parse_args()
    if a.steps < SLOW_AT + 100:
        ap.error(f"--steps {a.steps}: use at least {SLOW_AT + 100}")
    out = Path(tempfile.mkdtemp(prefix="fastft-stragglers-"))
    progress = Progress("stragglers", 2 * a.pairs + 3)
    step_ms: dict[str, list[float]] = {"off": [], "report": []}
    free_rates = []
    for i in range(a.pairs):
        for mode in ("off", "report"):
            progress.next(f"fault-free, --stragglers {mode}, pair {i + 1}")
            d = run(out, f"free-{mode}-{i}", mode, a, slow=False)
            step_ms[mode].append(median_step_ms(d))
            c = commits(d)
            free_rates.append(rate(c, SLOW_AT, max(c)))
    free = statistics.median(free_rates)
    rows = []
    for mode in ("off", "report", "replace"):
        progress.next(f"rank 1 at {a.factor}x, --stragglers {mode}")
        d = run(out, f"slow-{mode}", mode, a, slow=True)
        rows.append({"stragglers": mode, **judged(d, a, free)})
    progress.close()
    off, rep = statistics.median(step_ms["off"]), statistics.median(step_ms["report"])
    pairs = [r / o for o, r in zip(step_ms["off"], step_ms["report"], strict=True)]
    overhead = {  # (the median of each pair's ratio: the machine's noise moves both)
        "step_ms_off": round(off, 3),
        "step_ms_report": round(rep, 3),
        "pair_ratios": [round(x, 4) for x in pairs],
        "overhead": round(statistics.median(pairs) - 1, 4),
    }
    cols = ["stragglers", "named_after_steps", "ratio_named", "rate_after_slowdown"]
    cols += ["vs_fault_free", "rate_replaced", "replaced_vs_fault_free"]
    for r in rows:
        for c in cols:
            r.setdefault(c, None)
    meta = {"fault_free_rate": round(free, 2), "fault_free": overhead, "args": vars(a)}
    path = write("stragglers", rows, meta)
    print(table(rows, cols))
    print(
        f"fault-free: {free:.2f} steps/s; step {off:.2f} ms without detection, {rep:.2f} ms "
        f"with it ({overhead['overhead']:+.2%}); runs in {out}\nwritten {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
