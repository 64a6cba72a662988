"""What a lost node costs, with each control plane, side by side in one run.

* **Node loss -> the survivors' next commit**: 3 nodes on this machine (one agent and one
  worker each, in a process group of its own), elastic world (``--min-replicas 2``); at
  step 8 one node is SIGKILLed whole. Nobody's parent sees its worker die: another agent
  sees the node's lease run out (``--node-heartbeat-ms 100``, 3 misses: 300 ms) and
  declares it lost. Times from the kill: the declaration (``node_lost``) and the survivors'
  first commit in the next epoch. TCPStore: a node that is not the store host (node 0's
  loss ends the job there); NATS: every node in turn, node 0 included.
* **Fault-free step time**: the same 3-worker job on one node, the TCPStore control plane
  against the NATS one (a local 3-server cluster), at 10.8k and 4.2M parameters; rounds
  interleaved, the median round's ratio reported.

The bus broadcast (NATS against TCPStore, 16 and 64 subscribers) is
``bench/bus_latency.py``. Results: ``bench/results/node_loss.json`` and tables.

    python bench/node_loss.py [--trials 5] [--steady-rounds 3] [--sizes small large]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, pct, table, write  # noqa: E402
from recovery import SIZES, _free_port, _step_times, n_params, run_fastft  # noqa: E402

from fastft.bus.natscluster import LocalCluster  # noqa: E402
from fastft.protocol.auth import JobSecret  # noqa: E402
from fastft.runtime import read_events  # noqa: E402

LOSS_STEP = 8
STEPS = 40


def loss_trial(run: Path, control: str | None, lost: int) -> dict[str, float]:
    """One job of 3 nodes; node ``lost`` is SIGKILLed whole at step ``LOSS_STEP``."""
    plane = ["--control", control] if control else ["--store", f"127.0.0.1:{_free_port()}"]
    agents = []
    run.mkdir(parents=True)
    secret = JobSecret.draw().save(run / "job.secret")  # one for every node
    plane += ["--job-secret-file", str(secret)]
    for node in range(3):
        cmd = [
            *(sys.executable, "-m", "fastft.cli", "run", "--nproc", "1", "--nnodes", "3"),
            *("--node-rank", str(node), *plane, "--min-replicas", "2"),
            *("--job", run.name, "--run-dir", str(run), "-m", "fastft.demo.train"),
            *("--", "--steps", str(STEPS), "--step-time", "0.06"),
        ]
        log = open(run / f"node{node}.log", "wb")  # noqa: SIM115 - the child holds it
        agents.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()
    try:
        deadline = time.monotonic() + 120
        t_kill = None
        while t_kill is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run}: step {LOSS_STEP} never committed")
            try:
                ev = read_events(run)
            except FileNotFoundError:
                ev = []
            if any(e["event"] == "commit" and e["step"] >= LOSS_STEP for e in ev):
                t_kill = time.monotonic()
                os.killpg(agents[lost].pid, signal.SIGKILL)
            time.sleep(0.01)
        for i, p in enumerate(agents):
            if i != lost and p.wait(120) != 0:
                raise RuntimeError(f"{run}: node {i} failed: {(run / f'node{i}.log').read_text()}")
    finally:
        for p in agents:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    ev = read_events(run)
    declared = min(e["mono"] for e in ev if e["event"] == "node_lost" and e["node"] == lost)
    epoch = max(e["epoch"] for e in ev if e["event"] == "commit" and e["mono"] < t_kill)
    nxt = min(
        e["mono"]
        for e in ev
        if e["event"] == "commit" and e["epoch"] > epoch and e["mono"] > t_kill
    )
    return {"declared_ms": (declared - t_kill) * 1e3, "next_commit_ms": (nxt - t_kill) * 1e3}


def losses(trials: int, tmp: Path, cluster: LocalCluster) -> list[dict[str, object]]:
    got: dict[str, list[dict[str, float]]] = {"tcpstore": [], "nats": []}
    progress = Progress("node_loss", trials * 2)
    for t in range(trials):  # interleaved: the machine drifts
        progress.next(f"tcpstore, trial {t + 1}")
        got["tcpstore"].append(loss_trial(tmp / f"tcp-{t}", None, lost=1 + t % 2))
        progress.next(f"nats, trial {t + 1}")
        got["nats"].append(loss_trial(tmp / f"nats-{t}", cluster.address, lost=t % 3))
    progress.close()
    rows = []
    for plane, rs in got.items():
        d = [r["declared_ms"] for r in rs]
        c = [r["next_commit_ms"] for r in rs]
        rows.append(
            {
                "control": plane,
                "lost": "node 1 or 2" if plane == "tcpstore" else "node 0, 1 or 2",
                "n": len(rs),
                "declared_p50_ms": statistics.median(d),
                "next_commit_p50_ms": statistics.median(c),
                "next_commit_p99_ms": pct(c, 99),
                "next_commit_max_ms": max(c),
            }
        )
    return rows


def steady(size: str, rounds: int, steps: int, tmp: Path, cluster: LocalCluster) -> dict:
    hidden, layers = SIZES[size]
    pairs = []
    for i in range(rounds):
        d = tmp / f"steady-{size}-{i}"
        runs = {}
        for plane, flags in (("tcpstore", ()), ("nats", ("--control", cluster.address))):
            run = run_fastft(hidden, layers, steps, d, f"{plane}-{size}-{i}", flags=flags)
            runs[plane] = statistics.median(_step_times(run / "out", skip=10))
        pairs.append((runs["nats"] / runs["tcpstore"], runs["tcpstore"], runs["nats"]))
    ratio, tcp, nats = sorted(pairs)[len(pairs) // 2]
    return {
        "model": size,
        "params": n_params(hidden, layers),
        "rounds": rounds,
        "tcpstore_step_ms": round(tcp * 1e3, 3),
        "nats_step_ms": round(nats * 1e3, 3),
        "extra_ms_per_step": round((nats - tcp) * 1e3, 3),
        "ratio": round(ratio, 3),
        "ratio_range": f"{min(p[0] for p in pairs):.2f}-{max(p[0] for p in pairs):.2f}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steady-rounds", type=int, default=3)
    ap.add_argument("--steady-steps", type=int, default=150)
    ap.add_argument("--sizes", nargs="+", default=["small", "large"], choices=list(SIZES))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with LocalCluster(tmp / "nats") as cluster:
            loss_rows = losses(a.trials, tmp, cluster) if a.trials else []
            steady_rows = [
                steady(s, a.steady_rounds, a.steady_steps, tmp, cluster) for s in a.sizes
            ] if a.steady_rounds else []  # fmt: skip
    path = write(
        "node_loss",
        loss_rows + steady_rows,
        {"trials": a.trials, "heartbeat_ms": 100, "misses": 3, "step_time_s": 0.06},
    )
    if loss_rows:
        print("Node loss (SIGKILL of a node's agent and worker) -> survivors' next commit")
        cols = ["control", "lost", "n", "declared_p50_ms", "next_commit_p50_ms"]
        print(table(loss_rows, [*cols, "next_commit_p99_ms", "next_commit_max_ms"]))
    if steady_rows:
        print("\nFault-free step time, 3 workers: NATS control plane against TCPStore")
        cols = ["model", "params", "rounds", "tcpstore_step_ms", "nats_step_ms"]
        print(table(steady_rows, [*cols, "extra_ms_per_step", "ratio", "ratio_range"]))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
