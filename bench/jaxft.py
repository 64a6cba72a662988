"""fastft for JAX (issue 38), side by side in one run, 3 processes on this machine's CPUs
(Gloo), the JAX demo's MLP at 4.2M parameters (hidden 1024, 5 layers), global batch 96:

* fault-free step: fastft-JAX (``fastft.demo.train_jax``: a local jitted gradient, reduced
  by fastft's collective) against JAX's own multi-controller job (``jax.distributed``, the
  all-reduce inside the jitted step: ``bench/_jax_dist.py``) and fastft-torch on the same
  model (``fastft.demo.train``); the median time between steps.
* faults: one of the 3 processes gets a SIGKILL, an exception or a SIGSTOP at step 20.
  fastft-JAX under ``fastft run`` (no warm spare) against JAX's recoverable mode
  (``jax_enable_recoverability``, ``live_devices``, a 3 s heartbeat: the documentation's
  loop, adapted to CPU). From the fault to the survivors' next good step, and to the
  restarted process's first step (for JAX: a new process with the same process id, started
  as soon as the old one is gone; "never" if it has not trained a step within 30 s).

    python bench/jaxft.py [--trials 3] [--quick]

Results: bench/results/jaxft.json and a table. Needs the jax extra (make test-jax installs it).
(Not named ``jax.py``: the scripts in bench/ would import it as ``jax``.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, table, write  # noqa: E402

from fastft.report import summarize  # noqa: E402

HERE = Path(__file__).parent
NPROC, HIDDEN, LAYERS = 3, 1024, 5
MODEL = ["--hidden", str(HIDDEN), "--layers", str(LAYERS)]
KINDS = ("sigkill", "exception", "sigstop")
AT_STEP = 20
HEARTBEAT_S = 3
NEVER_S = 30.0


def _env() -> dict[str, str]:
    return {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fastft_run(run: Path, script: str, steps: int, plan: list[dict] | None = None) -> dict:
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(NPROC), "--run-dir", str(run)]
    if plan:
        run.mkdir(parents=True, exist_ok=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += ["-m", script, "--", "--steps", str(steps), *MODEL]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{script} failed ({p.returncode}): {p.stderr[-2000:]}")
    return summarize(run)


class JaxJob:
    """JAX's own 3-process job (bench/_jax_dist.py), one JSON line per step per process."""

    def __init__(self, d: Path, mode: str, steps: int, fault: str = "") -> None:
        self.d, self.mode, self.steps = d, mode, steps
        self.coordinator = f"127.0.0.1:{_port()}"
        self.procs = {i: self._start(i, fault if i == 1 else "") for i in range(NPROC)}

    def _start(self, i: int, fault: str, life: int = 0) -> subprocess.Popen:
        cmd = [sys.executable, str(HERE / "_jax_dist.py"), "--coordinator", self.coordinator]
        cmd += ["--nproc", str(NPROC), "--pid", str(i), "--mode", self.mode, *MODEL]
        cmd += ["--steps", str(self.steps), "--heartbeat", str(HEARTBEAT_S), "--fault", fault]
        cmd += ["--out", str(self.d / f"p{i}.{life}.jsonl")]
        with open(self.d / f"p{i}.{life}.log", "w") as log:  # (the child keeps its own fd)
            return subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)

    def records(self, i: int, life: int = 0) -> list[dict]:
        try:
            return [json.loads(x) for x in (self.d / f"p{i}.{life}.jsonl").read_text().splitlines()]
        except (OSError, json.JSONDecodeError):
            return []

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def jax_step_ms(d: Path, steps: int) -> float:
    job = JaxJob(d, "step", steps)
    try:
        for p in job.procs.values():
            p.wait(timeout=600)
    finally:
        job.stop()
    t = [r["t"] for r in job.records(0) if "ms" in r][10:]  # (after compiling)
    return statistics.median(b - a for a, b in zip(t, t[1:], strict=False)) * 1e3


def jax_fault(d: Path, kind: str, steps: int) -> dict:
    """JAX's recoverable mode under one fault of process 1: the survivors' next step, and
    a restarted process 1's first (None: not within NEVER_S)."""
    job = JaxJob(d, "recover", steps, fault=f"{kind}@{AT_STEP}")
    out: dict[str, object] = {"system": "jax-recoverable", "kind": kind}
    try:
        deadline = time.monotonic() + 120
        while not any("fault" in r for r in job.records(1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        (fault,) = [r for r in job.records(1) if "fault" in r]
        old = job.procs[1]
        if kind == "sigstop":  # (what fastft's agent does with a stopped worker)
            time.sleep(0.2)
            old.send_signal(signal.SIGKILL)
        old.wait(timeout=30)
        job.procs[1] = job._start(1, "", life=1)  # the restart, at once
        deadline = time.monotonic() + NEVER_S
        back = None
        while time.monotonic() < deadline and back is None:
            time.sleep(0.05)
            back = next((r for r in job.records(1, life=1) if "ms" in r), None)
        # (the survivors' step AT_STEP - 1 may end after process 1 wrote its fault)
        after = [r for r in job.records(0) if "ms" in r and r["step"] >= AT_STEP]
        seen = [r for r in job.records(0) if "failed" in r and r["t"] > fault["t"]]
        out["detect_ms"] = round((seen[0]["t"] - fault["t"]) * 1e3, 1) if seen else None
        out["survivors_ms"] = round((after[0]["t"] - fault["t"]) * 1e3, 1) if after else None
        out["restarted_ms"] = round((back["t"] - fault["t"]) * 1e3, 1) if back else None
        out["survivor_steps_after"] = len(after)
        out["survivors_finished"] = any(r["step"] == steps - 1 for r in after)
    finally:
        job.stop()
    return out


def fastft_fault(run: Path, kind: str, steps: int) -> dict:
    plan = [{"kind": kind, "rank": 1, "at_step": AT_STEP}]
    s = fastft_run(run, "fastft.demo.train_jax", steps, plan)
    (f,) = [f for f in s["faults"] if f["kind"] == kind]
    return {
        "system": "fastft-jax",
        "kind": kind,
        "detect_ms": f["detect_ms"],
        "survivors_ms": f["recover_ms"],
        "restarted_ms": f["rejoin_ms"] if kind != "exception" else None,
        "survivor_steps_after": s["steps_committed"] - AT_STEP,
        "survivors_finished": s["last_step"] == steps - 1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="fault-free steps per system")
    ap.add_argument("--quick", action="store_true", help="1 trial, 60 steps")
    a = ap.parse_args()
    trials, steps = (1, 60) if a.quick else (a.trials, a.steps)
    step_rows: list[dict[str, object]] = []
    fault_rows: list[dict[str, object]] = []
    with (
        Progress("jax", trials * (3 + 2 * len(KINDS))) as progress,
        tempfile.TemporaryDirectory(prefix="fastft-jax-") as tmp,
    ):
        d = Path(tmp)
        for t in range(trials):  # (interleaved: drift in the machine's load hits all)
            for system, script in (
                ("fastft-jax", "fastft.demo.train_jax"),
                ("fastft-torch", "fastft.demo.train"),
            ):
                progress.next(f"{system} step, trial {t}")
                s = fastft_run(d / f"{system}-{t}", script, steps)
                step_rows.append({"system": system, "trial": t, "step_ms": s["median_step_ms"]})
            progress.next(f"jax.distributed step, trial {t}")
            (d / f"dist-{t}").mkdir()
            ms = jax_step_ms(d / f"dist-{t}", steps)
            step_rows.append({"system": "jax.distributed", "trial": t, "step_ms": round(ms, 3)})
            for kind in KINDS:
                progress.next(f"fastft-jax {kind}, trial {t}")
                fault_rows.append(
                    {**fastft_fault(d / f"ff-{kind}-{t}", kind, 40 + AT_STEP), "trial": t}
                )
                progress.next(f"jax-recoverable {kind}, trial {t}")
                (d / f"jr-{kind}-{t}").mkdir()
                fault_rows.append(
                    {**jax_fault(d / f"jr-{kind}-{t}", kind, 40 + AT_STEP), "trial": t}
                )

    def med(rows: list[dict[str, object]], key: str) -> float | None:
        vals = [float(v) for r in rows if isinstance(v := r.get(key), int | float)]
        return round(statistics.median(vals), 1) if vals else None

    steps_summary = [
        {"system": s, "step_ms_p50": med([r for r in step_rows if r["system"] == s], "step_ms")}
        for s in ("fastft-jax", "jax.distributed", "fastft-torch")
    ]
    base = steps_summary[1]["step_ms_p50"] or 1.0
    for r in steps_summary:
        r["vs_jax_distributed"] = round(float(r["step_ms_p50"] or 0) / float(base), 2)
    faults_summary = []
    for kind in KINDS:
        for system in ("fastft-jax", "jax-recoverable"):
            mine = [r for r in fault_rows if r["system"] == system and r["kind"] == kind]
            back = [r["restarted_ms"] for r in mine]
            faults_summary.append(
                {
                    "kind": kind,
                    "system": system,
                    "trials": len(mine),
                    "detect_ms_p50": med(mine, "detect_ms"),
                    "survivors_next_step_ms_p50": med(mine, "survivors_ms"),
                    "restarted_first_step_ms_p50": "-"
                    if kind == "exception" and system == "fastft-jax"
                    else (
                        med(mine, "restarted_ms") if any(b is not None for b in back) else "never"
                    ),
                    "restarts_never_back": sum(b is None for b in back)
                    if not (kind == "exception" and system == "fastft-jax")
                    else "-",
                    "survivors_finished": sum(bool(r["survivors_finished"]) for r in mine),
                }
            )
    path = write(
        "jaxft",
        [*steps_summary, *faults_summary],
        {
            "model": {"hidden": HIDDEN, "layers": LAYERS, "params": 4_232_193, "nproc": NPROC},
            "heartbeat_s": HEARTBEAT_S,
            "trials": {"steps": step_rows, "faults": fault_rows},
        },
    )
    print(table(steps_summary, ["system", "step_ms_p50", "vs_jax_distributed"]))
    print()
    cols = [
        "kind",
        "system",
        "trials",
        "detect_ms_p50",
        "survivors_next_step_ms_p50",
        "restarted_first_step_ms_p50",
        "restarts_never_back",
        "survivors_finished",
    ]
    print(table(faults_summary, cols))
    print(f"\n{path}")


if __name__ == "__main__":
    main()
