"""Chaos soak (issue 25): random faults of every kind, at random moments, sent live over
the bus while earlier recoveries still run; then the job's history is checked.

One run: a fault-free reference of the same steps (its per-step digests), then the same
job under chaos: ``--warm-spares`` spares, a fault every ``--every`` seconds (uniform in
the range) on a random rank, and with probability ``--overlap`` a second fault shortly
after (``--overlap-delay``): inside the first one's rollback, heal or epoch formation.
Faults stop after ``--duration`` seconds; the job then runs to its end. The same
``--seed`` gives the same schedule (the moments the faults land are the machine's).

Checks (``ok``: all hold; what the CI version asserts):
  * history: every life committed consecutive steps (none applied twice or skipped; a
    total loss restored, or a rejoin, within a life starts it again there), and
    every step of the job was committed (S1);
  * digests: every member's digest after every step equals the reference's (S3 and S5);
  * regressions: no step was committed again after a later one was (training restarted
    from an earlier step) while a member held the committed state; with
    ``--checkpoint-dir`` a total loss may restore, and the steps redone are reported;
  * the job exited 0, no process of its session is left, its store port is closed.

Reported, not asserted (targets in issue 25): the survivors' next commit after each fault
by kind (p50, p99, max); the waits past their bound (3 s; a GIL hang: the hang timeout
+ 3 s) and whether another fault overlapped each (a backlog) or none did (unexplained: a
defect), and the waits of the faults nothing overlapped; committed steps per second
against the reference and (with ``--planned``) against the same faults at planned steps.

    python bench/chaos.py                       # the full soak: 600 s, 4 workers, 2 spares
    python bench/chaos.py --duration 60 --nproc 3 --spares 1 --out DIR   # the CI version
    python bench/chaos.py --ends 100            # 100 short soaks: does each end with 0?
    python bench/chaos.py --start-method spawn  # restarts and spares as new Pythons
    python bench/chaos.py --start-method both   # the same faults, forks against spawns
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import Progress, pct, table, write  # noqa: E402

from fastft.report import (  # noqa: E402
    shards_by_step,
    summarize,
    unlogged_commits,
    untiled_steps,
)
from fastft.runtime import read_events  # noqa: E402

KINDS = ("exception", "sigkill", "sigterm", "sigstop", "gil_hang", "segfault", "exit", "state_lost")
ARGS = {"exit": 3.0}
"""A kind's argument when the schedule drew none (an ``exit`` fault's status is drawn:
one of fastft's own 86-94 a third of the time, else any of 1-255; issue 48)."""


def schedule(
    seed: int,
    duration_s: float,
    nproc: int,
    every: tuple[float, float],
    overlap: float,
    overlap_delay: tuple[float, float],
    kinds: tuple[str, ...] = KINDS,
    sigterms: int | None = None,
) -> list[dict[str, Any]]:
    """The faults: (seconds after the job's first commit, rank, kind, and an ``exit``'s
    status), seeded. ``sigterms``: at most that many SIGTERMs (an elastic world: each
    drains its rank for good), on ranks not drained before."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    drained: set[int] = set()

    def draw(t: float) -> None:
        rank, kind = rng.randrange(nproc), rng.choice(kinds)
        if sigterms is not None and kind == "sigterm":
            if len(drained) >= sigterms or rank in drained:
                kind = rng.choice([k for k in kinds if k != "sigterm"] or ["sigkill"])
            else:
                drained.add(rank)
        if sigterms is not None and rank in drained and kind != "sigterm":
            rank = rng.choice([r for r in range(nproc) if r not in drained])
        f: dict[str, Any] = {"t": round(t, 3), "rank": rank, "kind": kind}
        if kind == "exit":  # (a third of them one of fastft's own, 86-94)
            f["arg"] = float(rng.randint(86, 94) if rng.random() < 0.3 else rng.randint(1, 255))
        out.append(f)

    t = rng.uniform(*every)
    while t < duration_s:
        draw(t)
        if rng.random() < overlap:
            t += rng.uniform(*overlap_delay)
            draw(t)
        t += rng.uniform(*every)
    return out


def _cmd(
    run: Path,
    a: argparse.Namespace,
    steps: int,
    extra: tuple[str, ...] = (),
    checkpoint: Path | None = None,
) -> list[str]:
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--nproc", str(a.nproc)),
        *("--run-dir", str(run), "--job", run.name, "--check-every", "1"),
        *("--max-restarts", "1000", "--hang-timeout", str(a.hang_timeout)),
        # a storm of faults on healthy workers on purpose: no slot is a repeat offender
        *("--quarantine", "off"),
        *("--start-method", a.start_method),
        *extra,
    ]
    if a.min_replicas:
        cmd += ["--min-replicas", str(a.min_replicas)]
    if a.adaptive_hang:
        cmd += ["--adaptive-hang"]
    if checkpoint is not None:
        cmd += ["--checkpoint-dir", str(checkpoint), "--checkpoint-every", "50"]
    cmd += ["-m", "fastft.demo.train", "--", "--steps", str(steps), "--out", str(run / "out")]
    return [*cmd, "--step-time", str(a.step_time)]


def _session_left(sid: int) -> list[int]:
    """Processes still in session ``sid`` (the launcher's: it was started in a new one)."""
    left = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                left.append(int(d))
    return left


def _store_port(run: Path) -> int | None:
    try:
        m = re.search(r"store 127\.0\.0\.1:(\d+)", (run / "launcher.log").read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_job(
    run: Path,
    cmd: list[str],
    faults: list[dict[str, Any]],
    timeout_s: float,
    last_step: int | None = None,
) -> dict[str, Any]:
    """Run ``cmd`` (a `fastft run`), sending ``faults`` live once it has committed; the
    job's exit status and what it left behind."""
    run.mkdir(parents=True, exist_ok=True)
    log = open(run / "launcher.log", "w")  # noqa: SIM115 - closed below
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sent: list[dict[str, Any]] = []
    try:
        if faults:
            sent = _inject(run, p, faults, time.monotonic() + timeout_s, last_step)
        rc = p.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # (the launcher's session: ours)
        rc = p.wait()
    finally:
        log.close()
    time.sleep(0.5)
    left = _session_left(p.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    port = _store_port(run)
    return {
        "rc": rc,
        "sent": sent,
        "left_processes": left,
        "port_open": port is not None and _port_open(port),
    }


class _Tail:
    """The newest committed step in an event log, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step = path, 0, -1

    def last_step(self) -> int:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            if b'"commit"' in line:
                try:
                    self.step = max(self.step, json.loads(line)["step"])
                except (ValueError, KeyError):
                    continue
        return self.step


def _inject(
    run: Path,
    p: subprocess.Popen[bytes],
    faults: list[dict[str, Any]],
    deadline: float,
    last_step: int | None,
) -> list[dict[str, Any]]:
    from fastft.bus import BusConfig, tcpstore_bus
    from fastft.bus.tcpstore import connect_store
    from fastft.protocol import NO_STEP, Inject, Role
    from fastft.protocol.auth import JobSecret

    while (port := _store_port(run)) is None or not (run / "events.jsonl").exists():
        if p.poll() is not None or time.monotonic() > deadline:
            return []
        time.sleep(0.1)
    while not any(e["event"] == "commit" for e in read_events(run)):  # every worker is up
        if p.poll() is not None or time.monotonic() > deadline:
            return []
        time.sleep(0.2)
    cfg = BusConfig(  # an operator of the job: it holds the job's secret
        job=run.name,
        rank=-1,
        incarnation=os.getpid(),
        role=Role.OPERATOR,
        subscribe=False,
        secret=JobSecret.load(run / "job.secret"),
    )
    bus = tcpstore_bus(connect_store(f"127.0.0.1:{port}", timeout_s=5.0), cfg).start()
    t0, sent, tail = time.monotonic(), [], _Tail(run / "events.jsonl")
    try:
        for f in faults:
            while time.monotonic() - t0 < f["t"]:
                if p.poll() is not None or (
                    last_step is not None and tail.last_step() >= last_step
                ):
                    return sent  # (a fault after the last step would fail the job's end)
                time.sleep(0.005)
            bus.broadcast(
                Inject(
                    job=run.name,
                    epoch=0,
                    rank=-1,
                    incarnation=os.getpid(),
                    role=Role.OPERATOR,
                    target_rank=f["rank"],
                    fault_kind=f["kind"],
                    at_step=NO_STEP,
                    arg=f.get("arg", ARGS.get(f["kind"], 0.0)),
                )
            )
            sent.append({**f, "mono": time.monotonic()})
    finally:
        bus.close()
    return sent


def check(
    run: Path, reference: dict[int, str], steps: int, elastic: bool = False
) -> dict[str, Any]:
    """The history checks (S1, S3/S5 against ``reference``, regressions) of ``run``. In an
    elastic world a step's digest depends on who trained it: S3 is then every member's
    digest equal per step and epoch, and S5 every sample of every step consumed once (the
    last epoch that committed a step: a restore trains steps again)."""
    ev = read_events(run)
    life: dict[str, int] = {}
    history: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    """(worker, life, restores it went through) -> the steps it committed, in order."""
    wrong: list[tuple[str, int]] = []
    first_commit: dict[int, float] = {}
    regressions: list[dict[str, Any]] = []
    again: set[int] = set()
    top = -1
    restores: dict[str, int] = defaultdict(int)
    for e in ev:
        if e["event"] == "worker_start":
            life[e["src"]] = e["life"]
        elif e["event"] in ("restore", "join_wait"):
            # a total loss restored, or a worker left out while it healed itself in place
            # joining again: the life goes on from the step it is given
            restores[e["src"]] += 1
        elif e["event"] == "commit":
            s = e["step"]
            history[(e["src"], life.get(e["src"], 0), restores[e["src"]])].append(s)
            if e.get("digest") is not None and not elastic and reference.get(s) != e["digest"]:
                wrong.append((e["src"], s))
            first_commit.setdefault(s, e["mono"])
            if s < top and s not in again:  # committed after a later step had been
                again.add(s)
                regressions.append({"step": s, "by": e["src"]})
            top = max(top, s)
    skipped = [
        (who, seq) for who, seq in history.items() if seq != list(range(seq[0], seq[0] + len(seq)))
    ]
    untiled: list[int] = []
    if elastic:
        wrong, untiled = _elastic_checks(ev)
    s = summarize(run)
    losses = s["total_losses"]
    return {
        "untiled_steps": untiled[:20],
        "holders_alive_at_a_loss": _holders_alive(ev, losses),
        "applied_twice_or_skipped": [
            f"{w[0]} life {w[1]}" + (f" after restore {w[2]}" if w[2] else "") + f": {q}"
            for w, q in skipped
        ][:10],
        "never_committed": sorted(set(range(steps)) - set(first_commit))[:20],
        "digest_mismatches": wrong[:20],
        "steps_trained_again": len(regressions),
        "total_losses": losses,
        "summary": s,
    }


def _elastic_checks(ev: list[dict[str, Any]]) -> tuple[list[tuple[str, int]], list[int]]:
    """(commits whose digest differs from another member's for the same step and epoch,
    steps whose last committing epoch did not consume the global batch exactly once)."""
    digests: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    last: dict[int, int] = {}
    for e in ev:
        if e["event"] == "commit":
            if e.get("digest") is not None:
                digests[(e["step"], e["epoch"])][e["src"]] = e["digest"]
            last[e["step"]] = max(last.get(e["step"], -1), e["epoch"])
    wrong = [
        (src, step) for (step, _), by in digests.items() if len(set(by.values())) > 1 for src in by
    ]
    commits = [*ev, *unlogged_commits(ev)]  # (voted to commit, then died before its log)
    final = [e for e in commits if e["event"] == "commit" and e["epoch"] == last.get(e["step"])]
    return wrong, untiled_steps(shards_by_step(final))


def _holders_alive(ev: list[dict[str, Any]], losses: list[dict[str, Any]]) -> list[str]:
    """Workers that held the committed state, and had not exited or lost it (a
    ``state_lost`` fault), when an epoch was closed as a total loss (the state discarded
    while a live member held it: never allowed)."""
    out = []
    for loss in losses:
        first = min(
            (e for e in ev if e["event"] == "epoch" and e["epoch"] == loss["epoch"]),
            key=lambda e: e["mono"],
        )
        t, lost = first["mono"], first["lost"]
        last: dict[tuple[int, int], int] = {}
        exited = set()
        lives: dict[str, int] = {}
        for e in ev:
            if e["mono"] >= t:
                break
            if e["event"] == "worker_start":
                lives[e["src"]] = e["life"]
            elif e["event"] == "commit" and e["src"].startswith("rank "):
                last[(int(e["src"][5:]), lives.get(e["src"], 0))] = e["step"]
            elif e["event"] == "injected" and e["kind"] == "state_lost":
                # alive, but it holds no state any more (until it commits again)
                last.pop((int(e["src"][5:]), lives.get(e["src"], 0)), None)
            elif e["event"] == "worker_exit":
                exited.add((e["rank"], e["life"]))
        out += [
            f"rank {r} life {n} (epoch {loss['epoch']})"
            for (r, n), step in last.items()
            if step >= lost - 1 and (r, n) not in exited
        ]
    return out


def recovery_by_kind(s: dict[str, Any], sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The survivors' next commit after each injected fault, by kind (ms), and over every
    kind (the last row, ``all``)."""
    by: dict[str, list[float]] = defaultdict(list)
    unrecovered: dict[str, int] = defaultdict(int)
    for f in s["faults"]:
        if "injected" not in f["seen_as"]:
            continue
        if f["recover_ms"] is None:
            unrecovered[f["kind"]] += 1
        else:
            by[f["kind"]].append(f["recover_ms"])
    kinds = sorted(set(by) | set(unrecovered) | {f["kind"] for f in sent})
    rows = []
    for k in kinds:
        v = by.get(k, [])
        rows.append(
            {
                "kind": k,
                "sent": sum(f["kind"] == k for f in sent),
                "landed": len(v) + unrecovered.get(k, 0),
                "p50_ms": round(pct(v, 50), 1) if v else None,
                "p99_ms": round(pct(v, 99), 1) if v else None,
                "max_ms": round(max(v), 1) if v else None,
            }
        )
    every = [x for v in by.values() for x in v]
    rows.append(
        {
            "kind": "all",
            "sent": len(sent),
            "landed": len(every) + sum(unrecovered.values()),
            "p50_ms": round(pct(every, 50), 1) if every else None,
            "p99_ms": round(pct(every, 99), 1) if every else None,
            "max_ms": round(max(every), 1) if every else None,
        }
    )
    return rows


def stalls(s: dict[str, Any], hang_timeout_s: float) -> dict[str, Any]:
    """Each landed fault's wait (the survivors' next commit) against its bound (issue 25:
    3 s; for a GIL hang, known only after the hang timeout, that + 3 s), and what explains
    a wait past it: other faults still in progress when it landed, or landing during its
    wait. A fault is in progress until the survivors' next commit and, where its rank was
    restarted, until that rank commits again (an elastic world goes on without a restarting
    rank, and the next fault may then leave it below ``--min-replicas``, waiting for that
    restart). ``isolated``: the waits of faults nothing overlapped; ``unexplained``: past
    the bound with nothing overlapping (a defect)."""
    landed = [f for f in s["faults"] if "injected" in f["seen_as"]]

    def ends(f: dict[str, Any]) -> float:
        """When ``f`` stops being in progress."""
        if f["recover_ms"] is None:
            return float("inf")
        return f["t"] + max(f["recover_ms"], f.get("rejoin_ms") or 0.0) / 1e3

    isolated: list[float] = []
    past = 0
    unexplained: list[dict[str, Any]] = []
    for f in landed:
        if f["recover_ms"] is None:
            continue
        wait_end = f["t"] + f["recover_ms"] / 1e3
        overlapped = [g for g in landed if g is not f and g["t"] <= wait_end and ends(g) >= f["t"]]
        bound = 1e3 * (3.0 + (hang_timeout_s if f["kind"] == "gil_hang" else 0.0))
        if not overlapped:
            isolated.append(f["recover_ms"])
        if f["recover_ms"] > bound:
            past += 1
            if not overlapped:
                unexplained.append({k: f.get(k) for k in ("kind", "rank", "step", "recover_ms")})
    return {
        "isolated": {
            "faults": len(isolated),
            "p50_ms": round(pct(isolated, 50), 1) if isolated else None,
            "p99_ms": round(pct(isolated, 99), 1) if isolated else None,
            "max_ms": round(max(isolated), 1) if isolated else None,
        },
        "past_bound": past,
        "past_bound_overlapped": past - len(unexplained),
        "unexplained": unexplained,
    }


def spares_under_load(ev: list[dict[str, Any]]) -> dict[str, Any]:
    """Warm spares under the soak's load (issue 37): each spare's warm-up (``spare_start``
    to ``spare_ready``), each used spare's refill (handed out to its replacement ready:
    the agent starts the replacement once the worker that took it has recovered, so this
    is the pool's gap, not a start's cost) and how the restarts started. Hand-outs are
    matched first-in first-out to the spares started after them."""
    started: dict[int, float] = {}
    ready: dict[int, float] = {}
    handed: list[float] = []
    waiting: list[float] = []  # hand-outs whose replacement has not started yet
    replacing: dict[int, float] = {}  # a replacement's pid -> the hand-out it replaces
    how: dict[str, int] = defaultdict(int)
    for e in ev:
        if e["event"] == "spare_start":
            started[e["pid"]] = e["mono"]
            if waiting:
                replacing[e["pid"]] = waiting.pop(0)
        elif e["event"] == "spare_ready":
            ready[e["pid"]] = e["mono"]
        elif e["event"] == "spawn" and e.get("life", 0) > 0:
            kind = "spare" if e.get("warm") else ("fork" if e.get("how") == "fork" else "spawn")
            how[kind] += 1
            if e.get("warm"):
                handed.append(e["mono"])
                waiting.append(e["mono"])
    warm = [1e3 * (ready[p] - t) for p, t in started.items() if p in ready]
    refill = [1e3 * (ready[p] - t) for p, t in replacing.items() if p in ready]

    def dist(v: list[float]) -> dict[str, Any]:
        return {
            "n": len(v),
            "p50_ms": round(pct(v, 50), 1) if v else None,
            "p99_ms": round(pct(v, 99), 1) if v else None,
            "max_ms": round(max(v), 1) if v else None,
        }

    return {
        "warm_up": dist(warm),
        "refill": dist(refill),
        "handed_out": len(handed),
        "never_refilled": len(handed) - len(refill),
        "restarts_by_start": dict(how),
    }


def _plan(out: Path, faults: list[dict[str, Any]], steps: int) -> Path:
    """The same faults at evenly spaced steps (a fault plan: each in the life its rank
    will be in by then)."""
    per = max(1, (steps - 10) // (len(faults) + 1))
    lives: dict[int, int] = defaultdict(int)
    plan = []
    for i, f in enumerate(faults):
        plan.append(
            {
                "kind": f["kind"],
                "rank": f["rank"],
                "at_step": (i + 1) * per,
                "life": lives[f["rank"]],
                "arg": f.get("arg", ARGS.get(f["kind"], 0.0)),
            }
        )
        if f["kind"] not in ("exception", "state_lost"):  # the others end the process
            lives[f["rank"]] += 1
    out.mkdir(parents=True, exist_ok=True)
    path = out / "planned.json"
    path.write_text(json.dumps({"faults": plan}))
    return path


def ends(a: argparse.Namespace, out: Path) -> int:
    """``--ends N``: N short soaks (a seeded schedule of faults over ~6 s each, each with
    its own durable tier unless ``--no-checkpoint``); how many ended with exit status 0,
    and with nothing left running (issue 25: the agent once ended with SIGABRT at the end
    of a soak), and how many failed saying why (exit 1 and a ``job failed:`` line)."""
    steps = max(100, int(10 / (a.step_time + 0.006)))
    got = []
    progress = Progress("chaos --ends", a.ends)
    for i in range(a.ends):
        progress.next(f"soak {i + 1}")
        run = out / f"end-{i}"
        faults = schedule(a.seed + i, 6.0, a.nproc, a.every, a.overlap, a.overlap_delay)
        ckpt = None if a.no_checkpoint else run / "ckpt"
        cmd = _cmd(run, a, steps, ("--warm-spares", str(a.spares)), ckpt)
        job = run_job(run, cmd, faults, 300, last_step=steps - 30)
        why = failed_line(run)
        got.append(
            {
                "run": i,
                "rc": job["rc"],
                "faults": len(job["sent"]),
                "failed": why,
                **_leftovers(job),
            }
        )
        print(
            f"end {i}: exit status {job['rc']}, {len(job['sent'])} faults"
            + (f": {why}" if why else "")
        )
    progress.close()
    ok = [g for g in got if g["rc"] == 0 and not g["left"]]
    said = [g for g in got if g["rc"] == 1 and g["failed"] and not g["left"]]
    result = {
        "ends": a.ends,
        "exit_0_and_clean": len(ok),
        "failed_with_a_reason": len(said),  # (exit 1 and one line that says why)
        "not": [g for g in got if g not in ok],
    }
    path = write(f"{a.name}-ends", got, {"result": result})
    print(json.dumps(result, indent=1), f"\nwritten {path}")
    return 0 if len(ok) == a.ends else 1


def failed_line(run: Path) -> str | None:
    """The launcher's ``fastft: job failed: ...`` line (why the job failed), or None."""
    try:
        text = (run / "launcher.log").read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"^fastft: job failed: (.*)$", text, flags=re.M)
    return found[-1][:300] if found else None


def _leftovers(job: dict[str, Any]) -> dict[str, Any]:
    return {"left": job["left_processes"] or (["store port"] if job["port_open"] else [])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--spares", type=int, default=2)
    ap.add_argument("--every", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN", "MAX"))
    ap.add_argument("--overlap", type=float, default=0.3, help="chance of a second fault")
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="the catalogue's kinds to draw from (an elastic world: a SIGTERM drains its "
        "rank for good, so at most --nproc minus --min-replicas are drawn)",
    )
    ap.add_argument("--overlap-delay", type=float, nargs=2, default=(0.02, 0.5))
    ap.add_argument("--step-time", type=float, default=0.03)
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="the job's steps (0: about --duration at half the fault-free rate; a run that "
        "keeps more than half ends before the last faults are sent)",
    )
    ap.add_argument("--hang-timeout", type=float, default=5.0)
    ap.add_argument(
        "--adaptive-hang",
        action="store_true",
        help="the agent's --adaptive-hang: a GIL hang is known after 20x the heartbeat gap "
        "(at least 2 s, at most --hang-timeout)",
    )
    ap.add_argument(
        "--min-replicas",
        type=int,
        default=0,
        help="an elastic world that goes on with this many (0: fixed; digests then agree "
        "per step, not with the reference, and every sample is consumed once)",
    )
    ap.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="the chaos run's durable tier (default: OUT/ckpt; every holder can be lost)",
    )
    ap.add_argument("--no-checkpoint", action="store_true", help="no durable tier")
    ap.add_argument(
        "--start-method",
        default="zygote",
        choices=("zygote", "spawn", "both"),
        help="fastft run --start-method: restarts and spares as forks of the node's zygote, "
        "or new Pythons (before issue 37); both: the same faults under each, side by side",
    )
    ap.add_argument("--planned", action="store_true", help="also the same faults at steps")
    ap.add_argument("--out", type=Path, default=None, help="run directories (default: tmp)")
    ap.add_argument("--name", default="chaos", help="result file bench/results/NAME.json")
    ap.add_argument("--json", type=Path, default=None, help="the result file (instead)")
    ap.add_argument("--ends", type=int, default=0, help="N short soaks: their exit status")
    a = ap.parse_args()
    if a.nproc < 2 or a.duration <= 0 or not 0 <= a.overlap <= 1:
        ap.error("--nproc >= 2, --duration > 0 and --overlap in [0, 1]")
    if not 0 <= a.min_replicas <= a.nproc:
        ap.error(f"--min-replicas {a.min_replicas}: use 0 (fixed) to --nproc {a.nproc}")
    if a.start_method == "both" and (a.ends or a.planned):
        ap.error("--start-method both runs one long soak: not with --ends or --planned")
    methods = ("zygote", "spawn") if a.start_method == "both" else (a.start_method,)
    out = a.out or Path(__import__("tempfile").mkdtemp(prefix="fastft-chaos-"))
    if a.ends > 0:
        return ends(a, out)
    if a.checkpoint_dir is None and not a.no_checkpoint:
        a.checkpoint_dir = out / "ckpt"
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds {a.kinds!r}: use kinds of {', '.join(KINDS)}")
    faults = schedule(
        a.seed,
        a.duration,
        a.nproc,
        a.every,
        a.overlap,
        a.overlap_delay,
        kinds,
        sigterms=a.nproc - a.min_replicas if a.min_replicas else None,
    )
    # steps: about --duration of training at the reference rate with the faults' cost
    steps = a.steps or max(100, int(a.duration / (a.step_time + 0.006) * 0.5))
    print(f"chaos: {len(faults)} faults over {a.duration:.0f} s, {steps} steps, out {out}")

    t = time.monotonic()
    # (the reference's start method changes nothing it is compared on)
    first = argparse.Namespace(**{**vars(a), "start_method": methods[0]})
    ref = run_job(out / "reference", _cmd(out / "reference", first, steps), [], a.duration * 3)
    ref_s = time.monotonic() - t
    reference = {
        e["step"]: e["digest"]
        for e in read_events(out / "reference")
        if e["event"] == "commit" and e.get("digest") is not None
    }
    if ref["rc"] != 0 or len(reference) != steps:
        print(f"the reference run failed (rc {ref['rc']}): see {out / 'reference'}")
        return 1
    soaks = {}
    for m in methods:
        ns = argparse.Namespace(**{**vars(a), "start_method": m})
        soaks[m] = soak(ns, out, faults, steps, both=len(methods) > 1)
        soaks[m]["result"]["steps_per_s"]["reference"] = round(steps / ref_s, 2)
        chaos_rate = soaks[m]["result"]["steps_per_s"]["chaos"]
        soaks[m]["result"]["rate_vs_reference"] = round(chaos_rate * ref_s / steps, 3)
    args = {k: str(v) for k, v in vars(a).items()}
    if len(methods) == 1:
        (one,) = soaks.values()
        meta: dict[str, Any] = {"result": one["result"], "args": args}
        rows = one["rows"]
    else:
        rows = side_by_side(soaks)
        meta = {"soaks": soaks, "args": args}
    if a.json is not None:
        a.json.write_text(json.dumps({"rows": rows, **meta}, indent=1))
        path = a.json
    else:
        path = write(a.name, rows, meta)
    for m, one in soaks.items():
        print(f"\n{m}:")
        report(one)
    if len(methods) > 1:
        print("\nside by side (the same faults, the same reference):")
        print(table(rows, ["figure", *methods]))
    print(f"written {path}")
    return 0 if all(one["result"]["ok"] for one in soaks.values()) else 1


def soak(
    a: argparse.Namespace, out: Path, faults: list[dict[str, Any]], steps: int, both: bool
) -> dict[str, Any]:
    """The job under chaos with ``a.start_method`` (run directory ``out/chaos``, or
    ``out/chaos-METHOD`` when ``both`` run), checked against ``out/reference``."""
    reference = {
        e["step"]: e["digest"]
        for e in read_events(out / "reference")
        if e["event"] == "commit" and e.get("digest") is not None
    }
    run = out / ("chaos" if not both else f"chaos-{a.start_method}")
    ckpt = a.checkpoint_dir / a.start_method if both and a.checkpoint_dir else a.checkpoint_dir
    spares = ("--warm-spares", str(a.spares))
    t = time.monotonic()
    job = run_job(
        run,
        _cmd(run, a, steps, spares, ckpt),
        faults,
        a.duration * 6,
        last_step=steps - 30,  # no fault in the job's last steps: its end must be clean
    )
    chaos_s = time.monotonic() - t
    got = check(run, reference, steps, elastic=bool(a.min_replicas))
    s = got.pop("summary")
    rows = recovery_by_kind(s, job["sent"])
    stall = stalls(s, a.hang_timeout)
    rate = {"chaos": s["steps_committed"] / chaos_s}
    if a.planned:
        t = time.monotonic()
        planned = run_job(
            out / "planned",
            _cmd(out / "planned", a, steps, (*spares, "--inject", str(_plan(out, faults, steps)))),
            [],
            a.duration * 6,
        )
        rate["planned"] = summarize(out / "planned")["steps_committed"] / (time.monotonic() - t)
        print(f"planned soak: exit status {planned['rc']}, {rate['planned']:.1f} steps/s")
    result = {
        "ok": job["rc"] == 0
        and not job["left_processes"]
        and not job["port_open"]
        and not got["applied_twice_or_skipped"]
        and not got["never_committed"]
        and not got["digest_mismatches"]
        and not got["untiled_steps"]
        and not got["holders_alive_at_a_loss"]
        and all(x["outcome"] == "restored" for x in got["total_losses"])
        and got["steps_trained_again"] <= sum(x["redone"] or 0 for x in got["total_losses"]),
        "start_method": a.start_method,
        "seed": a.seed,
        "faults_scheduled": len(faults),
        "faults_sent": len(job["sent"]),
        "steps": steps,
        "exit_status": job["rc"],
        "left_processes": job["left_processes"],
        "store_port_open": job["port_open"],
        **got,
        "stalls": stall,
        "spares": spares_under_load(read_events(run)),
        "restarts": s["restarts"],
        "epochs": s["epochs"],
        "steps_per_s": {k: round(v, 2) for k, v in rate.items()},
        "rate_vs_planned": round(rate["chaos"] / rate["planned"], 3) if a.planned else None,
        "run_dir": str(run),
    }
    return {"rows": rows, "result": result}


def report(one: dict[str, Any]) -> None:
    result = one["result"]
    print(table(one["rows"], ["kind", "sent", "landed", "p50_ms", "p99_ms", "max_ms"]))
    stall = result["stalls"]
    iso = stall["isolated"]
    print(
        f"waits past their bound: {stall['past_bound']} ({stall['past_bound_overlapped']} "
        f"overlapped by other faults, {len(stall['unexplained'])} unexplained); the "
        f"{iso['faults']} faults nothing overlapped: p50 {iso['p50_ms']} ms, p99 "
        f"{iso['p99_ms']} ms, max {iso['max_ms']} ms"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "total_losses"}, indent=1))


def side_by_side(soaks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per figure, one column per start method."""

    def ms(v: Any) -> str:
        return "-" if v is None else f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms"

    def dist(d: dict[str, Any]) -> str:
        return f"{ms(d['p50_ms'])} / {ms(d['p99_ms'])} / {ms(d['max_ms'])} (n {d.get('n', d.get('faults'))})"

    figures: dict[str, Any] = {
        "ok (every check held)": lambda r, rows: r["ok"],
        "faults sent / landed": lambda r, rows: f"{r['faults_sent']} / {rows[-1]['landed']}",
        "survivors' next commit, all kinds: p50 / p99 / max": lambda r, rows: dist(
            {**rows[-1], "n": rows[-1]["landed"]}
        ),
        "faults nothing overlapped: p50 / p99 / max": lambda r, rows: dist(r["stalls"]["isolated"]),
        "waits past their bound (overlapped, unexplained)": lambda r, rows: (
            f"{r['stalls']['past_bound']} ({r['stalls']['past_bound_overlapped']}, "
            f"{len(r['stalls']['unexplained'])})"
        ),
        "total losses (steps trained again)": lambda r, rows: (
            f"{len(r['total_losses'])} ({r['steps_trained_again']})"
        ),
        "committed steps/s vs fault-free": lambda r, rows: r["rate_vs_reference"],
        "restarts: on a spare / forked / spawned": lambda r, rows: " / ".join(
            str(r["spares"]["restarts_by_start"].get(k, 0)) for k in ("spare", "fork", "spawn")
        ),
        "a spare's warm-up: p50 / p99 / max": lambda r, rows: dist(r["spares"]["warm_up"]),
        "a used spare's refill: p50 / p99 / max": lambda r, rows: dist(r["spares"]["refill"]),
        "spares handed out (never refilled)": lambda r, rows: (
            f"{r['spares']['handed_out']} ({r['spares']['never_refilled']})"
        ),
    }
    return [
        {"figure": name, **{m: f(one["result"], one["rows"]) for m, one in soaks.items()}}
        for name, f in figures.items()
    ]


if __name__ == "__main__":
    sys.exit(main())
