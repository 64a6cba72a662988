"""A node lost on a Ray cluster: ``fastft ray run`` against the Ray guide's recovery, side
by side in one run, and how fast each one sees a process killed or stopped.

A Ray cluster of two nodes on this machine (a head and a second raylet, 3 CPUs each,
``ray.cluster_utils.Cluster``), the demo's model, 2 nodes x 2 workers, 0.05 s of simulated
compute per step. At step ``LOSS_STEP`` every process of the job on node 1 is SIGKILLed:

* **fastft**: ``fastft ray run`` (its defaults: 3 NATS server actors as the control plane,
  a standby agent per node), elastic (``--min-replicas 2``): once node 1's standby is warm,
  node 1's agent actor is killed, its agent and workers with it (their parent-death
  signal). The driver sees the actor die and tells the standby to go: it declares the
  dead workers dead and its own, forked from its warm zygote, join and heal from a
  survivor.
* **fastft, no standby** (``--no-standby-agents``): the same; the driver starts a new
  agent actor (a new Python, zygote and workers); the survivors learn of the loss from
  the node's lease.
* **Ray guide**: what the Ray + JAX resilient-training guide does, given its best case: one
  actor per worker (torch + gloo, the same model, data and step), rank 0 checkpointing
  every ``CKPT_EVERY`` steps; the driver waits on every actor's future at once (the guide
  polls every 30 s: that would add up to 30 s, not counted here), and on the first failure
  kills every actor, creates new ones, and they restore the newest checkpoint. Node 1's
  two worker actors are SIGKILLed.

Times from the kill: the failure seen (fastft: the node declared lost, or taken over by
its standby; guide: the driver's first failed future), the survivors' next commit, node 1's workers committing again, and
the steps trained twice (the commit after the loss against the last before it).

**Detection**: Ray's own (an actor's process SIGKILLed: until the owner's pending call
fails; SIGSTOPped: nothing is seen within ``STOP_WAIT_S``; an actor's restart: until the
new process answers) against fastft's agent in the same cluster (a worker SIGKILLed, and
one SIGSTOPped, by the fault injector: until the agent's event).

    python bench/ray_node_loss.py [--trials 5]      # make bench-ray

Results: ``bench/results/ray_node_loss.json`` and tables.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # (a cluster on 127.0.0.1)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import psutil  # noqa: E402
from _common import Progress, table, write  # noqa: E402
from _ray_guide import CKPT_EVERY, LOSS_STEP, STEP_TIME, STEPS, guide_trial, row  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

CPUS = 3
STOP_WAIT_S = 10.0


def _commits_from(run: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(e["event"] == "commit" and e["step"] >= step for e in read_events(run)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{run}: step {step} never committed (rc {proc.poll()})")


def _fastft(address: str, run: Path, steps: int, plan: list | None, *flags: str) -> Any:
    cmd = [sys.executable, "-m", "fastft.cli", "ray", "run", "--address", address]
    cmd += ["--nodes", "2", "--nproc", "2", "--run-dir", str(run), "--job", run.name, *flags]
    if plan:
        run.mkdir(parents=True, exist_ok=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += ["-m", "fastft.demo.train", "--", "--steps", str(steps), "--step-time", str(STEP_TIME)]
    run.parent.mkdir(parents=True, exist_ok=True)
    with open(run.parent / f"{run.name}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _agent_actor(node: int) -> psutil.Process:
    for p in psutil.Process().children(recursive=True):
        try:
            line = p.cmdline()
        except psutil.Error:
            continue
        flag = line.index("--node-rank") if "--node-rank" in line else -1
        agent = "--standby" not in line  # (a standby is not the node's agent yet)
        if "fastft.cli" in line and flag > 0 and line[flag + 1] == str(node) and agent:
            return p.parent()
    raise RuntimeError(f"no agent of node {node}")


def _said(run: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    log = run.parent / f"{run.name}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and text in log.read_text():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{run}: the driver never said {text!r} (rc {proc.poll()})")


def fastft_trial(address: str, run: Path, standby: bool) -> dict[str, float]:
    """``standby``: node 1's standby agent is warm when the kill lands (as in a job past
    its first minute), and takes the node over; else a new agent actor does."""
    flags = ("--min-replicas", "2", *(() if standby else ("--no-standby-agents",)))
    proc = _fastft(address, run, STEPS, None, *flags)
    try:
        _commits_from(run, LOSS_STEP, proc)
        if standby:
            _said(run, "node 1's standby agent is warm", proc)
        actor = _agent_actor(1)
        t_kill = time.monotonic()
        actor.send_signal(signal.SIGKILL)
        if proc.wait(timeout=300) != 0:
            raise RuntimeError(f"fastft ray run failed: {(run.parent / f'{run.name}.log')}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    ev = read_events(run)
    commits = [e for e in ev if e["event"] == "commit"]
    before = max(e["step"] for e in commits if e["mono"] < t_kill)
    epoch = max(e["epoch"] for e in commits if e["mono"] < t_kill)
    # (the node lost by its lease, or taken over by its standby first)
    declared = min(
        e["mono"] for e in ev if e["event"] in ("node_lost", "node_taken_over") and e["node"] == 1
    )
    # (a later epoch's commits: not a step the old lives finished as the kill landed)
    after = [e for e in commits if e["epoch"] > epoch]
    survivors = [e for e in after if e["src"] in ("rank 0", "rank 1")]
    back = [e for e in after if e["src"] in ("rank 2", "rank 3")]
    return row(t_kill, declared, survivors, back, before)


def ray_detection(ray: Any, trials: int) -> dict[str, Any]:
    """Ray's own: an actor's process SIGKILLed (the owner's pending call fails), one
    SIGSTOPped (the call is still pending after STOP_WAIT_S), a restart (until the new
    process answers)."""

    class Probe:
        def pid(self) -> int:
            return os.getpid()

        def sleep(self, s: float) -> None:
            time.sleep(s)

    cls = ray.remote(Probe)
    killed, restart, stopped = [], [], 0
    for _ in range(trials):
        a = cls.options(num_cpus=0, max_restarts=0).remote()  # (a restart delays the error)
        pid = ray.get(a.pid.remote(), timeout=60)
        pending = a.sleep.remote(60)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            ray.get(pending, timeout=60)
        except Exception:
            killed.append(time.monotonic() - t0)
        a = cls.options(num_cpus=0, max_restarts=1, max_task_retries=0).remote()
        pid = ray.get(a.pid.remote(), timeout=60)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while True:  # the restarted actor answering
            try:
                if ray.get(a.pid.remote(), timeout=60) != pid:
                    restart.append(time.monotonic() - t0)
                    break
            except Exception:
                time.sleep(0.01)
        ray.kill(a, no_restart=True)
        b = cls.options(num_cpus=0, max_restarts=0).remote()
        pid = ray.get(b.pid.remote(), timeout=60)
        pending = b.sleep.remote(60)
        time.sleep(0.3)
        os.kill(pid, signal.SIGSTOP)
        try:
            ray.get(pending, timeout=STOP_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            stopped += 1  # not seen
        except Exception:
            pass
        os.kill(pid, signal.SIGCONT)
        ray.kill(b, no_restart=True)
    return {
        "kill_ms": [x * 1e3 for x in killed],
        "restart_ms": [x * 1e3 for x in restart],
        "stop_unseen": stopped,
        "stop_trials": trials,
    }


def agent_detection(address: str, run: Path) -> dict[str, float]:
    """fastft's agent on the same cluster: a worker SIGKILLed and one SIGSTOPped."""
    plan = [
        {"kind": "sigkill", "rank": 3, "at_step": 5},
        {"kind": "sigstop", "rank": 2, "at_step": 15},
    ]
    proc = _fastft(address, run, 25, plan)
    if proc.wait(timeout=300) != 0:
        raise RuntimeError(f"fastft ray run failed: {run.parent / f'{run.name}.log'}")
    ev = read_events(run)
    out = {}
    for kind, rank, seen in (("sigkill", 3, "worker_exit"), ("sigstop", 2, "worker_stopped")):
        t0 = next(e["mono"] for e in ev if e["event"] == "injected" and e["kind"] == kind)
        t1 = next(
            e["detected"]
            for e in ev
            if e["event"] == seen and e["rank"] == rank and e["detected"] >= t0
        )
        out[f"{kind}_ms"] = (t1 - t0) * 1e3
    return out


def _p50(rows: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group

    node = {"num_cpus": CPUS, "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    results: dict[str, list] = {"fastft": [], "fastft_cold": [], "guide": [], "agent": []}
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        with (
            tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d,
            Progress("ray_node_loss", 4 * a.trials + 1) as bar,
        ):
            tmp = Path(d)
            for i in range(a.trials):  # (interleaved: the same machine's state for both)
                bar.next(f"fastft trial {i}")
                results["fastft"].append(fastft_trial(cluster.address, tmp / f"ff-{i}", True))
                bar.next(f"fastft without standby agents, trial {i}")
                cold = fastft_trial(cluster.address, tmp / f"ff-cold-{i}", False)
                results["fastft_cold"].append(cold)
                bar.next(f"guide trial {i}")
                ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
                pg = placement_group([{"CPU": CPUS}] * 2, strategy="SPREAD")
                ray.get(pg.ready(), timeout=60)
                try:
                    results["guide"].append(guide_trial(ray, pg, tmp / f"guide-{i}"))
                finally:
                    remove_placement_group(pg)
                    ray.shutdown()
                bar.next(f"agent detection {i}")
                results["agent"].append(agent_detection(cluster.address, tmp / f"detect-{i}"))
            bar.next("Ray's own detection")
            ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
            try:
                own = ray_detection(ray, a.trials)
            finally:
                ray.shutdown()
    finally:
        cluster.shutdown()
    rows: list[dict[str, object]] = []
    for name, how in (
        ("fastft ray run (standby agents)", "fastft"),
        ("fastft ray run --no-standby-agents", "fastft_cold"),
        ("Ray guide (best case)", "guide"),
    ):
        r = results[how]
        rows.append(
            {
                "recovery": name,
                "n": len(r),
                "seen_p50_ms": _p50(r, "seen_ms"),
                "survivors_p50_ms": _p50(r, "survivors_ms"),
                "node_back_p50_ms": _p50(r, "back_ms"),
                "redone_steps_p50": _p50(r, "redone_steps"),
            }
        )
    f, c, g = rows
    ratios = {
        "survivors_x": round(float(g["survivors_p50_ms"]) / float(f["survivors_p50_ms"]), 1),
        "node_back_x": round(float(g["node_back_p50_ms"]) / float(f["node_back_p50_ms"]), 1),
        "node_back_standby_x": round(
            float(c["node_back_p50_ms"]) / float(f["node_back_p50_ms"]), 1
        ),
    }
    agent = results["agent"]
    detection = [
        {
            "fault": "process SIGKILLed",
            "ray_p50_ms": round(statistics.median(own["kill_ms"]), 2),
            "fastft_agent_p50_ms": _p50(agent, "sigkill_ms"),
        },
        {
            "fault": "process SIGSTOPped",
            "ray_p50_ms": f"unseen in {STOP_WAIT_S:g} s ({own['stop_unseen']}/{own['stop_trials']})",
            "fastft_agent_p50_ms": _p50(agent, "sigstop_ms"),
        },
        {
            "fault": "actor restarted (until it answers)",
            "ray_p50_ms": round(statistics.median(own["restart_ms"]), 1),
            "fastft_agent_p50_ms": "-",
        },
    ]
    path = write(
        "ray_node_loss",
        [*rows, *detection],
        {
            "trials": a.trials,
            "ratios": ratios,
            "raw": {**results, "ray_own": own},
            "setup": {"nodes": 2, "nproc": 2, "cpus_per_node": CPUS, "step_time_s": STEP_TIME,
                      "loss_step": LOSS_STEP, "ckpt_every": CKPT_EVERY, "steps": STEPS},
        },
    )  # fmt: skip
    print("Node 1 lost (every process of the job on it SIGKILLed) at step", LOSS_STEP)
    print(table(rows, ["recovery", "n", "seen_p50_ms", "survivors_p50_ms", "node_back_p50_ms", "redone_steps_p50"]))  # fmt: skip
    print(f"ratios (guide / fastft; no standby / standby): {ratios}")
    print("\nDetection on the same cluster: Ray's own against fastft's agent")
    print(table(detection, ["fault", "ray_p50_ms", "fastft_agent_p50_ms"]))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
