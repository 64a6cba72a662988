"""Jobs that cannot go on end, with the reason and a non-zero exit, instead of restarting
forever (issue 23): a script that fails before its first commit in every worker fails
the job after one round; recoveries in a row without a commit (a fault storm) stop it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _runs import fastft_run

from fastft.protocol.exits import EXIT_FAULT_STORM
from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_a_script_that_cannot_start_fails_the_job_after_one_round(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("import fastft\nimport no_such_module_anywhere  # noqa\n")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "2", "--run-dir", str(run)]
    p = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "every worker failed before its first commit" in p.stderr
    assert "No module named 'no_such_module_anywhere'" in p.stderr
    # the traceback once; the other rank's (or life's) is one line pointing at it
    assert p.stderr.count("Traceback (most recent call last)") == 1, p.stderr[-3000:]
    assert "(the same traceback as rank " in p.stderr, p.stderr[-3000:]
    # the script's frame first, as python prints it (the zygote's and runpy's came first)
    lines = p.stderr.splitlines()
    first = lines[next(i for i, x in enumerate(lines) if "Traceback (most recent" in x) + 1]
    assert first.endswith(f'File "{script}", line 2, in <module>'), p.stderr[-3000:]
    spawns = [e for e in read_events(run) if e["event"] == "spawn"]
    # once both first lives failed (the first to fail may have started again meanwhile),
    # not after --max-restarts 3 rounds
    assert all(e["life"] <= 1 for e in spawns) and len(spawns) <= 3, spawns


def test_a_fault_storm_stops_the_job(tmp_path: Path):  # (~8 s: in make test)
    """Rank 1 dies at step 5 in every life: the survivors never commit step 5 again; after
    --max-recoveries 3 recoveries in a row they stop, and the job fails with the reason."""
    plan = [{"kind": "sigkill", "rank": 1, "at_step": 5, "life": life} for life in range(8)]
    run = fastft_run(
        tmp_path,
        "storm",
        "--max-recoveries",
        "3",
        "--max-restarts",
        "20",
        "--quarantine",
        "off",  # (rank 1 dies in every life: this is about the survivors' recoveries)
        plan=plan,
        expect_rc=1,
    )
    ev = read_events(run)
    storms = [e for e in ev if e["event"] == "fault_storm"]
    assert storms and all(e["step"] == 5 for e in storms)
    exits = {e["exit_code"] for e in ev if e["event"] == "worker_exit"}
    assert EXIT_FAULT_STORM in exits
    log = (run / "launcher.log").read_text()
    assert "fault storm" in log
    assert max(e["step"] for e in ev if e["event"] == "commit") == 4
