"""Drain (issue 23): a rank leaves at the step boundary after a commit and its peers
re-form without rolling anything back. Asked for by a SIGTERM to the worker (a preemption
notice), by ``fastft drain --rank R`` on the bus, or by a SIGTERM to the agent (every rank
drains and the agent exits 0, leaving a checkpoint with the durable tier; the same
command resumes). In a fixed world the drained rank starts again and heals. Every run
checks S1, S3 and S5 (bitwise equal to the fault-free run) and counts rollbacks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _runs import STEPS, check_s1_s3, fastft_run, finals

from fastft.protocol import EXIT_DRAINED
from fastft.protocol.auth import JobSecret
from fastft.protocol.exits import JOB_PREEMPTED
from fastft.runtime import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SLOW = ("--step-time", "0.2")  # time to reach the job with a command mid-run


def drained(run: Path) -> list[tuple[int, int]]:
    """(rank, life) of every exit after a drain."""
    return sorted(
        (e["rank"], e["life"])
        for e in read_events(run)
        if e["event"] == "worker_exit" and e["exit_code"] == EXIT_DRAINED
    )


def rollbacks(run: Path) -> list[int]:
    return [e["step"] for e in read_events(run) if e["event"] == "rollback"]


def check_result(run: Path, clean: dict[int, dict]) -> None:
    check_s1_s3(run)
    assert {v["digest"] for v in finals(run).values()} == {clean[0]["digest"]}


def test_a_sigterm_drains_the_rank_with_no_rollback_and_its_restart_heals(tmp_path, clean):
    plan = [{"kind": "sigterm", "rank": 1, "at_step": 10}]
    run = fastft_run(tmp_path, "sigterm", plan=plan)
    check_result(run, clean)
    assert drained(run) == [(1, 0)]
    assert rollbacks(run) == []
    ev = read_events(run)
    left = next(e for e in ev if e["event"] == "drained")
    assert left["src"] == "rank 1" and left["step"] > 10  # at a commit after the request
    fetched = [e for e in ev if e["event"] == "heal" and e["role"] == "fetch" and e["step"]]
    assert [(e["src"], e["step"]) for e in fetched] == [("rank 1", left["step"])]


def test_two_ranks_drained_in_the_same_step(tmp_path, clean):
    plan = [
        {"kind": "sigterm", "rank": 1, "at_step": 10},
        {"kind": "sigterm", "rank": 2, "at_step": 10},
    ]
    run = fastft_run(tmp_path, "two", plan=plan)
    check_result(run, clean)
    assert drained(run) == [(1, 0), (2, 0)]
    assert rollbacks(run) == []


def test_a_drain_asked_during_a_heal_leaves_after_it(tmp_path, clean):
    """Rank 2 dies at step 8; rank 0, the heal's source, is told to drain as it sends the
    heal. It finishes the heal, then leaves (one rollback: the death's)."""
    plan = [
        {"kind": "sigkill", "rank": 2, "at_step": 8},
        {"kind": "sigterm", "rank": 0, "at_step": 8, "point": "heal"},
    ]
    run = fastft_run(tmp_path, "heal", plan=plan)
    check_result(run, clean)
    assert drained(run) == [(0, 0)]
    assert rollbacks(run) and set(rollbacks(run)) == {8}


def _start(run: Path, *flags: str, steps: int = STEPS) -> subprocess.Popen[bytes]:
    run.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)]
    cmd += ["--check-every", "1", "--job", run.name, *flags]
    cmd += ["-m", "fastft.demo.train", "--", "--steps", str(steps), "--out", str(run / "out")]
    cmd += SLOW
    log = open(run / "launcher.log", "ab")  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def _wait_commit(run: Path, step: int, p: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.poll() is None, (run / "launcher.log").read_text()[-3000:]
        try:
            if any(e["event"] == "commit" and e["step"] >= step for e in read_events(run)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"no commit of step {step}")


def _finish(p: subprocess.Popen[bytes], run: Path, timeout: float = 150) -> int:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(30)
        raise AssertionError((run / "launcher.log").read_text()[-3000:]) from None


def test_fastft_drain_of_rank_0_on_the_bus(tmp_path, clean):
    run = tmp_path / "drain0"
    p = _start(run)
    try:
        _wait_commit(run, 5, p)
        agent = next(e for e in read_events(run) if e["event"] == "agent_start")
        drain = [sys.executable, "-m", "fastft.cli", "drain", "--store", agent["store"]]
        drain += ["--job", run.name, "--job-secret-file", str(run / "job.secret"), "--rank", "0"]
        subprocess.run(drain, check=True, timeout=60, capture_output=True)
    finally:
        assert _finish(p, run) == 0
    check_result(run, clean)
    assert drained(run) == [(0, 0)]
    assert rollbacks(run) == []


def test_a_sigterm_to_the_agent_drains_every_rank_exits_143_and_the_job_resumes(tmp_path, clean):
    """A preempted job is no finished job: a batch scheduler reads 0 as done. It exits
    JOB_PREEMPTED (143, as a shell reports a SIGTERM) and says how to resume."""
    run, ck = tmp_path / "preempt", tmp_path / "ck"
    flags = ("--checkpoint-dir", str(ck), "--checkpoint-every", "1000")  # (none by schedule)
    p = _start(run, *flags)
    try:
        _wait_commit(run, 8, p)
        p.send_signal(signal.SIGTERM)  # the agent: a preemption notice for the whole job
    finally:
        rc = _finish(p, run)
    log = (run / "launcher.log").read_text()
    assert rc == JOB_PREEMPTED, log[-3000:]
    assert "job preempted (SIGTERM)" in log and f"restores the newest checkpoint in {ck}" in log
    assert [r for r, _ in drained(run)] == [0, 1, 2]
    ev = read_events(run)
    assert rollbacks(run) == []
    left = {e["step"] for e in ev if e["event"] == "drained"}
    saved = [e["step"] for e in ev if e["event"] == "checkpoint_staged"]
    assert saved and max(saved) == max(left)  # the last commit before leaving is saved
    again = fastft_run(tmp_path, "preempt-resumed", *flags)  # the same command, resumed
    restored = [e for e in read_events(again) if e["event"] == "restore"]
    assert restored and restored[0]["step"] == max(saved)
    assert {v["digest"] for v in finals(again).values()} == {clean[0]["digest"]}


def test_fastft_drain_of_a_node_drains_its_ranks_and_its_agent_exits_0(tmp_path):
    run = tmp_path / "drain-node"
    p = _start(run)
    try:
        _wait_commit(run, 5, p)
        agent = next(e for e in read_events(run) if e["event"] == "agent_start")
        drain = [sys.executable, "-m", "fastft.cli", "drain", "--store", agent["store"]]
        drain += ["--job", run.name, "--job-secret-file", str(run / "job.secret"), "--node", "0"]
        subprocess.run(drain, check=True, timeout=60, capture_output=True)
    finally:
        assert _finish(p, run) == 0, (run / "launcher.log").read_text()[-3000:]
    assert [r for r, _ in drained(run)] == [0, 1, 2]
    assert rollbacks(run) == []
    assert max(e["step"] for e in read_events(run) if e["event"] == "commit") < STEPS - 1


def test_fastft_report_error_restarts_the_rank_and_it_heals(tmp_path, clean):
    """An outside monitor's Fault1 (`fastft report-error`, no incarnation: the rank's
    current life) makes its agent restart it; the new process heals, and the job ends
    bitwise equal to the clean run. (Not a drain: the operator commands share the helpers.)"""
    run = tmp_path / "reported"
    p = _start(run)
    try:
        _wait_commit(run, 5, p)
        agent = next(e for e in read_events(run) if e["event"] == "agent_start")
        cmd = [sys.executable, "-m", "fastft.cli", "report-error", "--store", agent["store"]]
        cmd += ["--job", run.name, "--job-secret-file", str(run / "job.secret"), "--rank", "1"]
        subprocess.run([*cmd, "--cause", "Xid 79 (test)"], check=True, timeout=60)
    finally:
        assert _finish(p, run) == 0, (run / "launcher.log").read_text()[-3000:]
    check_result(run, clean)
    ev = read_events(run)
    (killed,) = [e for e in ev if e["event"] == "kill_declared_dead"]
    assert killed["rank"] == 1 and "Xid 79" in killed["cause"]
    # one recovery: the report and the exit of the life it named are one death (counted
    # as two, the survivors left the re-formed epoch in silence: a 60 s stall)
    log = (run / "launcher.log").read_text()
    assert "DistStoreError" not in log and "wait timeout" not in log, log[-3000:]
    assert not [e for e in ev if e["event"] == "rollback" and not e["reason"]]
    assert [e["life"] for e in ev if e["event"] == "spawn" and e["rank"] == 1] == [0, 1]
    rep = subprocess.run(
        [sys.executable, "-m", "fastft.cli", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    faults = json.loads(rep.stdout)["faults"]
    # one fault of rank 1: the report as the worker logged it, or (when its agent killed
    # it before it read the report) the exit
    assert [f["rank"] for f in faults] == [1], faults
    assert faults[0]["kind"] in ("reported", "worker_exit"), faults


def test_an_elastic_world_drained_below_its_floor_fails_with_the_reason(tmp_path):
    """Elastic (--min-replicas 2 of 3): each drained rank leaves for good; once two have,
    the one left can never form a world. The job fails at once and says why, instead of
    waiting below the floor forever (found by the elastic chaos soak)."""
    plan = [
        {"kind": "sigterm", "rank": 1, "at_step": 8},
        {"kind": "sigterm", "rank": 2, "at_step": 16},
    ]
    run = fastft_run(tmp_path, "floor", "--min-replicas", "2", plan=plan, expect_rc=1, timeout=120)
    log = (run / "launcher.log").read_text()
    assert "fell below --min-replicas 2 for good: 1 of 3 workers left" in log, log[-3000:]
    ev = read_events(run)
    drained_ranks = {
        e["rank"] for e in ev if e["event"] == "worker_exit" and e["exit_code"] == EXIT_DRAINED
    }
    assert drained_ranks == {1, 2}
    mine = [e["step"] for e in ev if e["event"] == "commit" and e["src"] == "rank 0"]
    assert mine == list(range(len(mine))) and len(mine) >= 17  # (its history, to the end)


def test_workers_waiting_to_join_leave_at_once_when_drained(tmp_path):
    """Node 1 of a 2-node job starts alone (the store hosted apart, by `fastft store`): its
    workers wait to join a world that cannot form yet. A SIGTERM to its agent drains them;
    they hold nothing the job needs, so they leave at once (drained), not after the
    agent's grace (found by the chaos soak: a joiner sat out the 30 s grace, then was
    killed)."""
    run = tmp_path / "join-drain"
    secret = JobSecret.draw().save(tmp_path / "job.secret")
    store = subprocess.Popen(
        [sys.executable, "-m", "fastft.cli", "store", "--bind", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stdout is not None
        address = store.stdout.readline().strip()
        flags = ("--nnodes", "2", "--node-rank", "1", "--store", address)
        p = _start(run, *flags, "--job-secret-file", str(secret))
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert p.poll() is None, (run / "launcher.log").read_text()[-3000:]
                ev = read_events(run) if (run / "events.jsonl").exists() else []
                if len({e["src"] for e in ev if e["event"] == "join_wait"}) == 3:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the workers never waited to join")
            p.send_signal(signal.SIGTERM)
        finally:
            rc = _finish(p, run)
            assert rc == JOB_PREEMPTED, (run / "launcher.log").read_text()[-3000:]
    finally:
        store.terminate()
        store.wait(30)
    assert [r for r, _ in drained(run)] == [3, 4, 5]  # EXIT_DRAINED, not killed after a grace
    assert len([e for e in read_events(run) if e["event"] == "drain_from_join"]) == 3
