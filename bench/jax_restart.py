"""A JAX restart with an outside-sized model (issue 52), side by side with the torch path:
``examples/jax_transformer.py`` (4.2M parameters: 5 layers, width 256, 4 heads, context
64; optax clipping + AdamW + warmup-cosine, dropout from ``tx.key``, three pytrees
registered as a build) and, for torch, the demo's MLP at 4.2M parameters
(``fastft.demo.train --hidden 1024 --layers 5``). 3 workers under ``fastft run`` on this
machine's CPUs (Gloo), the job secret on; process 1 gets a SIGKILL at step 25 of 40.

Rows (each N trials, interleaved):

* ``jax cold``: no spare; the restart is a fork of the node's zygote (JAX imported), the
  script runs, registers its build (not run: the worker is healed), traces its step and
  loads the executables from the persistent compilation cache.
* ``jax warm``: ``--warm-spares 1``: a spare with torch, fastft and JAX imported, which
  runs the script only once it replaces the worker (then as a cold restart does, minus
  the fork).
* ``jax spare``: ``--warm-spares 1 --spare-run-ahead``: the spare rehearsed the first step
  (fastft.jax.rehearsal); once it replaces the worker it joins, is healed and steps.
* ``jax elastic``: ``--min-replicas 2``, no spare: the survivors go on as 2 (their shard
  of the global batch changes shape, so their step traces and compiles again).
* ``torch cold`` / ``torch spare``: the same for the torch demo, the reference.

Figures: from the fault to the survivors' first step decided after it (``fastft report``'s
recovery), to the restarted worker's first commit, the median fault-free step, and what
the restarted worker's first step traced and compiled (``jax_first_step``).

    python bench/jax_restart.py [--trials 3] [--quick]

Results: bench/results/jax_restart.json and a table. Needs the jax extra (make test-jax).
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
from _common import Progress, table, write  # noqa: E402

from fastft.report import summarize  # noqa: E402
from fastft.runtime import read_events  # noqa: E402

EXAMPLE = Path(__file__).parents[1] / "examples" / "jax_transformer.py"
AT_STEP, STEPS, NPROC = 25, 40, 3
TARGET_MS = {"jax cold": 1000, "jax warm": 1000, "jax spare": 300, "jax elastic": 1000}
"""Issue 65's targets for the survivors' next commit (a plain warm spare runs the script,
hence traces, only once it replaces the worker: a cold start's target)."""
SYSTEMS: dict[str, tuple[list[str], list[str]]] = {  # flags, script and its arguments
    "jax cold": ([], [str(EXAMPLE), "--"]),
    "jax warm": (["--warm-spares", "1"], [str(EXAMPLE), "--"]),
    "jax spare": (["--warm-spares", "1", "--spare-run-ahead"], [str(EXAMPLE), "--"]),
    "jax elastic": (["--min-replicas", "2"], [str(EXAMPLE), "--"]),
    "torch cold": ([], ["-m", "fastft.demo.train", "--", "--hidden", "1024", "--layers", "5"]),
    "torch spare": (
        ["--warm-spares", "1", "--spare-run-ahead"],
        ["-m", "fastft.demo.train", "--", "--hidden", "1024", "--layers", "5"],
    ),
}


def one(run: Path, system: str) -> dict[str, object]:
    flags, script = SYSTEMS[system]
    run.mkdir(parents=True)
    (run / "plan.json").write_text(
        json.dumps({"faults": [{"kind": "sigkill", "rank": 1, "at_step": AT_STEP}]})
    )
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(NPROC), "--run-dir", str(run)]
    cmd += ["--inject", str(run / "plan.json"), *flags, *script, "--steps", str(STEPS)]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{system} failed ({p.returncode}): {p.stderr[-2000:]}")
    s = summarize(run)
    (f,) = s["faults"]
    first = [
        e
        for e in read_events(run)
        if e["event"] == "jax_first_step" and e["src"] == "rank 1" and e["step"] >= AT_STEP
    ]
    return {
        "system": system,
        "survivors_ms": f["recover_ms"],
        "restarted_ms": f["rejoin_ms"],
        "step_ms": s["median_step_ms"],
        "traces": first[0]["traces"] if first else None,
        "compile_ms": first[0]["compile_ms"] if first else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 trial")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="which rows, comma-separated")
    a = ap.parse_args()
    trials = 1 if a.quick else a.trials
    systems = [s for s in a.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {', '.join(sorted(unknown))} (known: {', '.join(SYSTEMS)})")
    rows: list[dict[str, object]] = []
    with (
        Progress("jax_restart", trials * len(systems)) as progress,
        tempfile.TemporaryDirectory(prefix="fastft-jax-restart-") as tmp,
    ):
        for t in range(trials):  # (interleaved: drift in the machine's load hits all)
            for system in systems:
                progress.next(f"{system}, trial {t}")
                rows.append(
                    {**one(Path(tmp) / f"{system.replace(' ', '-')}-{t}", system), "trial": t}
                )

    def med(mine: list[dict[str, object]], key: str) -> float | None:
        vals = [float(v) for r in mine if isinstance(v := r.get(key), int | float)]
        return round(statistics.median(vals), 1) if vals else None

    summary = []
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        summary.append(
            {
                "system": system,
                "trials": len(mine),
                "survivors_next_commit_ms_p50": med(mine, "survivors_ms"),
                "restarted_committing_ms_p50": med(mine, "restarted_ms"),
                "step_ms_p50": med(mine, "step_ms"),
                "first_step_traces": med(mine, "traces") if system.startswith("jax") else "-",
                "first_step_compile_ms": med(mine, "compile_ms")
                if system.startswith("jax")
                else "-",
            }
        )
    ref = {s["system"]: s["survivors_next_commit_ms_p50"] for s in summary}
    for s in summary:
        base = (
            None
            if "elastic" in str(s["system"])
            else ref.get("torch spare" if "spare" in str(s["system"]) else "torch cold")
        )
        mine_ms = s["survivors_next_commit_ms_p50"]
        s["vs_torch"] = round(float(mine_ms) / float(base), 2) if mine_ms and base else "-"
        s["target_ms"] = TARGET_MS.get(str(s["system"]), "-")
    path = write(
        "jax_restart",
        summary,
        {
            "model": {
                "jax": "examples/jax_transformer.py --size 4m (4.2M parameters)",
                "torch": "fastft.demo.train --hidden 1024 --layers 5 (4.2M parameters)",
            },
            "fault": {"kind": "sigkill", "rank": 1, "at_step": AT_STEP, "steps": STEPS},
            "trials": rows,
        },
    )
    cols = [
        "system",
        "trials",
        "survivors_next_commit_ms_p50",
        "target_ms",
        "restarted_committing_ms_p50",
        "vs_torch",
        "step_ms_p50",
        "first_step_traces",
        "first_step_compile_ms",
    ]
    print(table(summary, cols))
    print(f"\n{path}")


if __name__ == "__main__":
    main()
