"""What a new user meets (issue 24): Ctrl-C stops a job quietly, and the stop is not
counted as a fault."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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
    rep = subprocess.run(
        [sys.executable, "-m", "fastft.cli", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(rep.stdout)["faults"] == []
