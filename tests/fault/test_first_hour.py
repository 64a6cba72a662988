"""What a new user meets (issue 24): Ctrl-C stops a job quietly, and the stop is not
counted as a fault."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fastft.runtime import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_ctrl_c_stops_the_job_without_tracebacks_and_report_counts_no_fault(tmp_path: Path):
    run = tmp_path / "ctrl-c"
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "2", "--warm-spares", "1"]
    cmd += ["--run-dir", str(run), "-m", "fastft.demo.train", "--", "--steps", "100000"]
    p = subprocess.Popen(
        [*cmd, "--step-time", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ev = read_events(run) if (run / "events.jsonl").exists() else []
            names = {e["event"] for e in ev}
            if "spare_ready" in names and any(e["event"] == "commit" for e in ev):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the job did not start")
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C: every process of the group
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
    assert "fastft: job stopped (Ctrl-C)" in err, err[-3000:]  # (not silent)
    rep = subprocess.run(
        [sys.executable, "-m", "fastft.cli", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    got = json.loads(rep.stdout)
    assert got["faults"] == [] and got["outcome"]["ended"] == "interrupted", got["outcome"]
    # the zygote is ended too (the order, workers signalled first, is
    # tests/unit/test_leaving.py's: here the workers' exits race the zygote's stop)
    assert any(e["event"] == "zygote_stop" for e in read_events(run))


WANT = (
    'fastft_faults_total{kind="exception"} 1.0',
    "fastft_steps_rolled_back_total 1.0",
    "fastft_recovery_seconds_count 1.0",
)


def test_the_agent_serves_prometheus_metrics_while_the_job_runs(tmp_path: Path):
    run = tmp_path / "metrics"
    plan = tmp_path / "plan.json"
    # (and one the job never reaches: its end says so, issue 53)
    faults = [
        {"kind": "exception", "rank": 1, "at_step": 5},
        {"kind": "sigkill", "rank": 0, "at_step": 99},
    ]
    plan.write_text(json.dumps({"faults": faults}))
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "2", "--metrics-port", "0"]
    cmd += ["--inject", str(plan), "--run-dir", str(run), "-m", "fastft.demo.train", "--"]
    p = subprocess.Popen(
        [*cmd, "--steps", "60", "--step-time", "0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    text = ""
    try:
        deadline = time.monotonic() + 90
        url = None
        while time.monotonic() < deadline and p.poll() is None:
            ev = read_events(run) if (run / "events.jsonl").exists() else []
            url = url or next((e["url"] for e in ev if e["event"] == "metrics"), None)
            if url is not None:
                with urllib.request.urlopen(url, timeout=10) as r:
                    text = r.read().decode()
                if all(want in text for want in WANT):  # (counted as the recovery goes)
                    break
            time.sleep(0.5)
        assert url is not None and url.startswith("http://127.0.0.1:")
    finally:
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert all(want in text for want in WANT), text
    never = (
        "fastft: warning: planned fault never fired: sigkill on rank 0 at step 99: the job ended"
    )
    assert never in err and "never fired: exception" not in err, err[-3000:]
    committed = next(
        float(x.split()[1]) for x in text.splitlines() if x.startswith("fastft_committed_steps ")
    )
    assert committed > 5


def test_forgetting_register_fails_the_job_once_with_the_reason_and_no_abort(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, fastft\n"
        "ft = fastft.init()\n"
        "with ft.transaction() as tx:  # no ft.register\n"
        "    pass\n"
    )
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "2"]
    p = subprocess.run(
        [*cmd, "--run-dir", str(tmp_path / "run"), str(script)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "call ft.register(model=..., optimizer=...) before a transaction" in p.stderr
    assert "every worker failed before its first commit" in p.stderr
    assert "terminate called" not in p.stderr and "SIGABRT" not in p.stderr
    spawns = [e for e in read_events(tmp_path / "run") if e["event"] == "spawn"]
    assert all(e["life"] <= 1 for e in spawns), spawns  # one round, not --max-restarts
    exits = [e for e in read_events(tmp_path / "run") if e["event"] == "worker_exit"]
    # no abort (a life started meanwhile is killed when the job fails: SIGKILL)
    assert all(e["signal"] in (None, signal.SIGKILL) for e in exits), exits


@pytest.mark.timeout(300)
def test_the_demo_explains_itself_and_ends_with_the_next_steps(tmp_path: Path):
    """Its table's columns said nothing of what they measure from, it warned about its
    own CPU use, the report's heading read as a command, and it ended without a next step
    (issue 53)."""
    cmd = [sys.executable, "-m", "fastft.cli", "demo", "--steps", "40", "--nproc", "2"]
    p = subprocess.run(
        [*cmd, "--run-dir", str(tmp_path), "--no-live"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "WARNING" not in out, out[-3000:]
    assert f"Report of the run in {tmp_path / 'faulty'}" in p.stdout
    assert "survivors' next commit, when they committed a step again" in p.stdout
    tail = p.stdout.strip().splitlines()[-5:]
    assert "S5 equivalence (the run with faults ends bitwise equal" in tail[0], tail
    assert "HOLDS" in tail[0] and tail[2].startswith("Next: wrap your own training loop"), tail
    assert (
        tail[-1]
        == f"and see this run's timeline: fastft report {tmp_path / 'faulty'} --plot timeline.png"
    )
