"""The durable tier, side by side in one run (3 Gloo workers on CPU, the 4.2M-parameter MLP
of bench/recovery.py):

* fault-free step time with no checkpoint, with fastft's asynchronous checkpoint every
  ``--every`` steps (``--checkpoint-dir``), and with a synchronous ``dcp.save`` of the same
  state at the same interval (rank 0, in the step loop: the usual way); the stall per
  checkpoint (fastft's staging copy, from its ``checkpoint_staged`` events) and the
  writer's time (``checkpoint`` events). Target: fastft's <= 3 % over no checkpoint.
* a total loss (every worker SIGKILLed after a step's commit decision) -> the next commit,
  restored from the newest checkpoint (cold restarts, and with 3 warm spares), against a cold ``torchrun`` restart of plain DDP
  that loads the same checkpoint (from its launch to its first step done).

    python bench/checkpoint.py [--steps 300] [--every 50] [--rounds 2] [--trials 3]

Results: bench/results/checkpoint.json and two tables.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402
from recovery import NPROC, SIZES, WORKER, _env, _step_times, n_params, run_fastft  # noqa: E402

from fastft.runtime import read_events  # noqa: E402


def steady(steps: int, every: int, rounds: int, tmp: Path) -> dict[str, object]:
    hidden, layers = SIZES["large"]
    per: dict[str, list[float]] = {"none": [], "fastft": [], "sync_dcp": []}
    stage, write_ms, mb, cpu_ms = [], [], [], []
    for r in range(rounds):  # interleaved, so that drift hits every variant alike
        for variant in per:
            flags: tuple[str, ...] = ()
            extra: list[str] = []
            if variant == "fastft":
                flags = ("--checkpoint-dir", str(tmp / f"ck-{r}"), "--checkpoint-every", str(every))
            elif variant == "sync_dcp":
                extra = ["--sync-ckpt", str(tmp / f"sync-{r}"), "--every", str(every)]
            run = run_fastft(
                hidden, layers, steps, tmp, f"{variant}-{r}", flags=flags, worker_args=extra
            )
            # the mean: a checkpoint's cost lands on one step in `every`
            per[variant].append(statistics.fmean(_step_times(run / "out", skip=10)) * 1e3)
            for e in read_events(run):
                if e["event"] == "checkpoint_staged":
                    stage.append(e["stage_ms"])
                elif e["event"] == "checkpoint":
                    write_ms.append(e["write_ms"])
                    mb.append(e["mb"])
                    if e.get("cpu_ms") is not None:
                        cpu_ms.append(e["cpu_ms"])
    base = statistics.median(per["none"])
    out: dict[str, object] = {"params": n_params(hidden, layers), "steps": steps, "every": every}
    for variant, ms in per.items():
        out[variant] = {
            "mean_step_ms": round(statistics.median(ms), 3),
            "rounds_ms": [round(v, 3) for v in ms],
            "over_none_pct": round((statistics.median(ms) / base - 1) * 100, 2),
        }
    out["stage_ms_p50"] = round(statistics.median(stage), 3) if stage else None
    out["write_ms_p50"] = round(statistics.median(write_ms), 3) if write_ms else None
    out["checkpoint_mb"] = mb[0] if mb else None
    # What the writer takes from the workers on a machine with no idle core: its CPU time
    # per checkpoint, as a share of every core over one checkpoint interval (the step
    # loop's own cost per checkpoint is the staging copy)
    interval_ms = every * base
    cpus = os.cpu_count() or 1
    if cpu_ms:
        out["writer_cpu_ms_p50"] = round(statistics.median(cpu_ms), 1)
        out["writer_cpu_share_pct"] = round(
            statistics.median(cpu_ms) / (interval_ms * cpus) * 100, 2
        )
    if stage:
        out["staging_share_pct"] = round(statistics.median(stage) / interval_ms * 100, 2)
    return out


def total_loss(trials: int, every: int, tmp: Path) -> dict[str, object]:
    hidden, layers = SIZES["large"]
    cold_ms: list[float] = []
    ms: dict[str, list[float]] = {"fastft": [], "fastft_warm_spares": []}
    for t in range(trials):
        at = 3 * every + 7
        plan = [
            {"kind": "sigkill", "rank": r, "at_step": at, "point": "commit"} for r in range(NPROC)
        ]
        for variant, extra in (("fastft", ()), ("fastft_warm_spares", ("--warm-spares", "3"))):
            ck = tmp / f"loss-ck-{t}-{variant}"
            flags = ("--checkpoint-dir", str(ck), "--checkpoint-every", str(every), *extra)
            run = run_fastft(
                hidden, layers, at + 10, tmp, f"loss-{t}-{variant}", plan=plan, flags=flags
            )
            ev = read_events(run)
            kill = min(e["t"] for e in ev if e["event"] == "injected")
            restored = min(e["t"] for e in ev if e["event"] == "restore")
            after = [e["t"] for e in ev if e["event"] == "commit" and e["t"] > restored]
            ms[variant].append((min(after) - kill) * 1e3)
        # the same checkpoint, loaded by a cold torchrun restart of plain DDP
        (saved,) = sorted(ck.glob("step-*"))[-1:]
        out = tmp / f"cold-{t}"
        port = _free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd += [WORKER, "--mode", "ddp", "--steps", "2", "--resume-from", str(saved)]
        cmd += ["--hidden", str(hidden), "--layers", str(layers), "--out", str(out)]
        t0 = time.time()
        p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"torchrun failed: {p.stderr[-2000:]}")
        firsts = [json.loads(f.read_text()) for f in out.glob("first-step-rank*.json")]
        cold_ms.append((max(firsts) - t0) * 1e3)
    cold = statistics.median(cold_ms)
    out_doc: dict[str, object] = {
        "torchrun_cold_restart_to_first_step_ms": [round(v, 1) for v in cold_ms],
        "torchrun_p50_ms": round(cold, 1),
    }
    for variant, got in ms.items():
        out_doc[f"{variant}_kill_to_next_commit_ms"] = [round(v, 1) for v in got]
        out_doc[f"{variant}_p50_ms"] = round(statistics.median(got), 1)
        out_doc[f"torchrun_over_{variant}"] = round(cold / statistics.median(got), 2)
    return out_doc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--parts", default="steady,loss", help="steady, loss or both")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fastft-ckpt-bench-") as d:
        tmp = Path(d)
        parts = set(a.parts.split(","))
        st = steady(a.steps, a.every, a.rounds, tmp) if "steady" in parts else None
        loss = total_loss(a.trials, a.every, tmp) if "loss" in parts else None
    rows: list[dict[str, object]] = []
    if st is not None:
        rows = [
            {
                "variant": v,
                "mean_step_ms": st[v]["mean_step_ms"],  # type: ignore[index]
                "over_none_pct": st[v]["over_none_pct"],  # type: ignore[index]
            }
            for v in ("none", "fastft", "sync_dcp")
        ]
        print(f"fault-free, {st['params']:,} parameters, checkpoint every {a.every} steps:")
        print(table(rows, ["variant", "mean_step_ms", "over_none_pct"]))
        print(
            f"fastft: staging {st['stage_ms_p50']} ms per checkpoint (the step loop's stall), "
            f"writer {st['write_ms_p50']} ms for {st['checkpoint_mb']} MB"
        )
        print(
            f"writer CPU {st.get('writer_cpu_ms_p50')} ms per checkpoint: "
            f"{st.get('writer_cpu_share_pct')} % of all {os.cpu_count()} cores over an interval; "
            f"staging {st.get('staging_share_pct')} % of the interval"
        )
    if loss is not None:
        print("total loss -> next step:")
        cols = ["fastft_p50_ms", "fastft_warm_spares_p50_ms", "torchrun_p50_ms"]
        print(table([loss], [*cols, "torchrun_over_fastft", "torchrun_over_fastft_warm_spares"]))
    write("checkpoint", rows, {"steady": st, "total_loss": loss})


if __name__ == "__main__":
    main()
