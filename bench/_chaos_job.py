"""The chaos soak's job (:mod:`chaos`): the `fastft run` it starts, the faults it sends
live over the bus on its schedule, and what the job left behind."""

from __future__ import annotations

import argparse
import json
import os
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

from fastft.runtime import read_events  # noqa: E402

KINDS = ("exception", "sigkill", "sigterm", "sigstop", "gil_hang", "segfault", "exit", "state_lost")
ARGS = {"exit": 3.0}


def job_command(
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
    if a.hang == "fixed":
        cmd += ["--no-hang-pace"]
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


def plan_file(out: Path, faults: list[dict[str, Any]], steps: int) -> Path:
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


def leftovers(job: dict[str, Any]) -> dict[str, Any]:
    return {"left": job["left_processes"] or (["store port"] if job["port_open"] else [])}
