"""Two versions of fastft side by side: ``bench/recovery.py --quick`` (small model; SIGKILL,
exception and SIGSTOP in every world; one fault-free round) of each tree, interleaved
round by round in one run, so that both see the same machine. Each tree runs its own
benchmark script against its own source (``PYTHONPATH=TREE/src``).

    git worktree add ../before <commit>
    python bench/ab.py --a ../before --b . --rounds 3

Results: bench/results/ab.json and a table: per fault and world, the p50 over rounds of
the survivors' next commit after the fault, with the range, for each tree; and the
fault-free extra ms per step over DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402


def run_once(tree: Path, faults: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    cmd = [sys.executable, str(tree / "bench/recovery.py"), "--quick", "--faults", faults]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads((tree / "bench/results/recovery-quick.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="the first tree (e.g. the commit before)")
    ap.add_argument("--b", default=".", help="the second tree (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--faults", default="sigkill,exception,sigstop")
    args = ap.parse_args()
    trees = {"a": Path(args.a).resolve(), "b": Path(args.b).resolve()}
    runs: dict[str, list[dict[str, object]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            print(f"round {r + 1}/{args.rounds}: {name} ({trees[name]})", flush=True)
            runs[name].append(run_once(trees[name], args.faults))
    rows = []
    keys = sorted(
        {(row["fault"], row["world"]) for doc in runs["a"] for row in doc["rows"]},  # type: ignore[index]
    )
    for fault, world in keys:
        row: dict[str, object] = {"fault": fault, "world": world}
        for name in ("a", "b"):
            vals = [
                float(x["next_commit_p50_ms"])
                for doc in runs[name]
                for x in doc["rows"]  # type: ignore[attr-defined]
                if x["fault"] == fault and x["world"] == world and x["next_commit_p50_ms"]
            ]
            row[f"{name}_p50_ms"] = round(statistics.median(vals), 1) if vals else None
            row[f"{name}_range"] = f"{min(vals):.1f}-{max(vals):.1f}" if vals else ""
        rows.append(row)
    steady = {"fault": "none (extra ms/step over DDP)", "world": "steady"}
    for name in ("a", "b"):
        vals = [float(doc["steady"][0]["extra_ms_per_step"]) for doc in runs[name]]  # type: ignore[index]
        steady[f"{name}_p50_ms"] = round(statistics.median(vals), 2)  # type: ignore[assignment]
        steady[f"{name}_range"] = f"{min(vals):.2f}-{max(vals):.2f}"
    rows.append(steady)
    path = write("ab", rows, {"trees": {k: str(v) for k, v in trees.items()}, "runs": runs})
    cols = ["fault", "world", "a_p50_ms", "a_range", "b_p50_ms", "b_range"]
    print(table(rows, cols))
    print(f"a = {trees['a']}\nb = {trees['b']}\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
