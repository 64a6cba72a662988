"""``fastft report``: what a user reads after a run (issue 40, item 11), from event logs
written here with the real EventLog."""

from __future__ import annotations

import time

from fastft.process.events import EventLog
from fastft.report import render_report, summarize


def _logs(tmp_path, *srcs):
    return [EventLog(tmp_path, s) for s in srcs]


def _close(*logs):
    for log in logs:
        log.close()


def test_a_monitors_report_is_one_fault_with_its_cause(tmp_path):
    agent, r0, r1 = _logs(tmp_path, "agent 0", "rank 0", "rank 1")
    r0.emit("commit", epoch=1, step=4)
    agent.emit("kill_declared_dead", rank=1, incarnation=7, cause="Xid 79", by="monitor")
    r0.emit("peer_fault", rank=1, incarnation=0, severity="FAULT1", cause="Xid 79")
    agent.emit("worker_exit", rank=1, incarnation=7, exit_code=None, signal=9, life=0)
    r0.emit("commit", epoch=2, step=5)
    _close(agent, r0, r1)
    s = summarize(tmp_path)
    (f,) = s["faults"]
    assert (f["rank"], f["kind"], f["cause"], f["step"]) == (1, "reported", "Xid 79", 5)
    assert f["seen_as"] == ["kill_declared_dead", "worker_exit"] and f["detect_ms"] is not None
    assert "| reported: Xid 79 | 5 |" in render_report(tmp_path, s)


def test_a_total_loss_has_no_survivors_commit_and_the_job_ending_exits_are_no_faults(tmp_path):
    agent, r0 = _logs(tmp_path, "agent 0", "rank 0")
    r0.emit("commit", epoch=1, step=9)
    agent.emit("worker_exit", rank=0, incarnation=3, exit_code=1, signal=None, life=0)
    r0.emit("epoch", epoch=2, members=[0], step=10, lost=10)
    agent.emit("worker_exit", rank=0, incarnation=4, exit_code=86, signal=None, life=1)
    agent.emit("job_failed", reason="every holder lost")
    agent.emit("worker_exit", rank=1, incarnation=5, exit_code=None, signal=9, life=1)
    _close(agent, r0)
    s = summarize(tmp_path)
    assert [(f["rank"], f["total_loss"]) for f in s["faults"]] == [(0, True)]
    assert "- (no survivor)" in render_report(tmp_path, s)
    assert s["offenders"] == []  # (the agent's kill as the job failed is no second fault)


def test_a_lost_node_is_one_fault_of_its_ranks_not_the_survivors(tmp_path):
    agent, r0, r2 = _logs(tmp_path, "agent 0", "rank 0", "rank 2")
    r0.emit("commit", epoch=1, step=2)
    r0.emit("local_fault", step=3, epoch=1, cause="CollectiveFailed: reset", incarnation=1)
    agent.emit("node_lost", node=1, lease=4, lives=2, ranks=[2, 3], lease_ms=300)
    r0.emit("commit", epoch=2, step=3)
    time.sleep(0.01)
    r2.emit("commit", epoch=3, step=9)  # (its new life, back: a new agent's, on Ray)
    _close(agent, r0, r2)
    (f,) = summarize(tmp_path)["faults"]
    assert (f["rank"], f["kind"], f["step"]) == ("node 1 (ranks 2,3)", "node_lost", 3)
    assert f["recover_ms"] is not None and f["recover_ms"] < f["rejoin_ms"]  # (its row, issue 60)


def test_two_runs_in_one_directory_are_apart_and_the_last_is_reported(tmp_path):
    for job in ("first", "second"):
        agent, r0 = _logs(tmp_path, "agent 0", "rank 0")
        agent.emit("agent_start", node_rank=0, job=job)
        for step in range(3 if job == "first" else 5):
            r0.emit("commit", epoch=1, step=step)
        _close(agent, r0)
        time.sleep(0.01)
    last = summarize(tmp_path)
    assert (last["run"], last["runs"], last["steps_committed"]) == (2, 2, 5)
    assert summarize(tmp_path, run=0)["steps_committed"] == 3
    assert "run 2 of the 2 in this directory" in render_report(tmp_path, last)


def test_checkpoints_written_skipped_and_failed_are_counted(tmp_path):
    (r0,) = _logs(tmp_path, "rank 0")
    r0.emit("commit", epoch=1, step=1)
    r0.emit("checkpoint", step=2)
    r0.emit("checkpoint_skipped", step=4, reason="previous write running")
    r0.emit("checkpoint_failed", step=6, error="disk full")
    _close(r0)
    s = summarize(tmp_path)
    assert s["checkpoints"] == {"written": 1, "skipped": 1, "failed": 1}
    assert "checkpoints: 1 written, 1 skipped" in render_report(tmp_path, s)


def test_a_job_stopped_by_the_replica_check_says_what_differed_and_where(tmp_path):
    r0, r1, r2 = _logs(tmp_path, "rank 0", "rank 1", "rank 2")
    why = "the replicas diverged: at the start of step 5 (epoch 1) 'ema' differs on rank 2"
    for r in (r0, r1, r2):
        r.emit("commit", epoch=1, step=4)
        r.emit("replicas_diverged", epoch=1, step=5, items=["ema"], minority=[2], error=why)
    _close(r0, r1, r2)
    s = summarize(tmp_path)
    (x,) = s["stopped"]
    assert (x["step"], x["items"], x["minority"], x["ranks"]) == (5, ["ema"], [2], [0, 1, 2])
    text = render_report(tmp_path, s)
    assert "the job stopped at step 5: the replicas diverged" in text
    assert "differs: ema on ranks [2]" in text and why in text


def test_the_report_says_how_the_job_ended_and_why(tmp_path):
    """Finished, failed (the agent's reason), preempted, interrupted, or not ended; and a
    status of fastft's without its record is a fault of the script's own (issue 48)."""
    cases = {
        "finished": [("agent_stop", {"failed": None})],
        "failed": [("job_failed", {"reason": "rank 1: the replicas hold different state"})],
        "preempted": [("drain", {"why": "SIGTERM"}), ("agent_stop", {"failed": None})],
        "interrupted": [("stop", {"signal": 2}), ("agent_stop", {"failed": None})],
        "running": [],
    }
    for ended, agent_events in cases.items():
        d = tmp_path / ended
        agent, r0 = _logs(d, "agent 0", "rank 0")
        for step in range(3):
            r0.emit("commit", epoch=1, step=step)
        # an 88 the script chose (no record: ending None) is its fault, not a drain
        agent.emit(
            "worker_exit", rank=0, incarnation=3, exit_code=88, signal=None, life=0, ending=None
        )
        for name, kw in agent_events:
            agent.emit(name, **kw)
        _close(agent, r0)
        s = summarize(d)
        assert s["outcome"]["ended"] == ended and s["outcome"]["steps"] == 3, s["outcome"]
        text = render_report(d, s)
        assert text.splitlines()[1].startswith("the job "), text
        assert [f["kind"] for f in s["faults"]] == ["worker_exit"], s["faults"]
    failed = summarize(tmp_path / "failed")["outcome"]
    assert failed["why"] == "rank 1: the replicas hold different state"


def test_planned_faults_that_never_fired_are_listed_with_why(tmp_path):
    """A fault without ``life`` on a rank restarted before its step never fires, and a
    fault after the job's last step neither; both were silent (issue 53)."""
    plan = [
        {"kind": "sigkill", "rank": 1, "at_step": 2, "life": 0, "point": "step"},
        {"kind": "exception", "rank": 1, "at_step": 4, "life": 0, "point": "step"},
        {"kind": "exception", "rank": 0, "at_step": 50, "life": 0, "point": "step"},
    ]
    agent, r0, r1 = _logs(tmp_path, "agent 0", "rank 0", "rank 1")
    agent.emit("agent_start", nproc=2, plan=plan)
    r0.emit("worker_start", incarnation=10, life=0)
    r1.emit("worker_start", incarnation=11, life=0)
    for step in range(2):
        r0.emit("commit", epoch=1, step=step)
    r1.emit("injected", kind="sigkill", point="step", step=2, epoch=1, incarnation=11)
    r1.emit("worker_start", incarnation=12, life=1)
    for step in range(2, 6):
        r0.emit("commit", epoch=2, step=step)
    agent.emit("agent_stop", failed=None)
    _close(agent, r0, r1)
    s = summarize(tmp_path)
    got = [(f["rank"], f["at_step"], f["why"]) for f in s["outcome"]["unfired"]]
    assert got == [
        (
            1,
            4,
            "rank 1's life 0 ended before step 4: a fault fires in one life of its rank "
            '(0 unless it says "life")',
        ),
        (0, 50, "the job ended before step 50"),
    ]
    text = render_report(tmp_path, s)
    assert "planned fault never fired: exception on rank 1 at step 4" in text, text


def test_a_long_cause_is_shortened_at_a_word(tmp_path):
    """The report cut causes at 60 characters, mid-word ("... inside ft.tr"; issue 53)."""
    agent, r0 = _logs(tmp_path, "agent 0", "rank 0")
    cause = "RuntimeError: the loader's worker 3 died unexpectedly while prefetching batch 1234"
    r0.emit("local_fault", step=4, epoch=1, severity="FAULT2", cause=cause, incarnation=1)
    _close(agent, r0)
    text = render_report(tmp_path, summarize(tmp_path))
    want = "| local_fault: RuntimeError: the loader's worker 3 died unexpectedly while ... |"
    assert want in text, text


def test_a_commit_voted_then_lost_in_an_epochs_first_step_still_tiles_it(tmp_path):
    """A member healed into an epoch, voted its first step and hung before its commit event
    (the elastic chaos soak, twice): the others' commits alone left the step untiled, a
    false S5 failure. Its adoption of the epoch stands for the commit before."""
    from fastft.report import shards_by_step, unlogged_commits, untiled_steps
    from fastft.runtime import read_events

    logs = _logs(tmp_path, "rank 0", "rank 1", "rank 2")
    view = {
        "epoch": 177,
        "members": [0, 1, 2],
        "incarnations": [10, 11, 12],
        "step": 2917,
        "needs_state": [0],
        "kept": [[2, 64, 96, 96]],
    }
    for log in logs:
        log.emit("epoch", **view)
    logs[2].emit("commit", epoch=177, step=2917, shard=[43, 64, 96], kept=[64, 96, 96])
    logs[1].emit("commit", epoch=177, step=2917, shard=[22, 43, 96])
    logs[1].emit("peer_fault", rank=0, incarnation=10, severity="FAULT1", cause="rank 0 hung")
    _close(*logs)
    ev = read_events(tmp_path)
    assert untiled_steps(shards_by_step(ev)) == [2917]
    (got,) = unlogged_commits(ev)
    assert (got["src"], got["step"], got["shard"]) == ("rank 0", 2917, [0, 22, 96])
    assert untiled_steps(shards_by_step([*ev, got])) == []


def test_recovery_counts_the_first_step_decided_after_the_fault(tmp_path):
    """A kill at the commit point: the others commit the step they voted for 1 ms later;
    that step was decided before the fault, and is not the survivors' recovery."""
    agent, r0 = _logs(tmp_path, "agent 0", "rank 0")
    r0.emit("commit", epoch=1, step=6)
    agent.emit("injected", rank=1, incarnation=3, kind="sigkill", step=7, point="commit")
    r0.emit("commit", epoch=1, step=7)  # voted before the kill
    agent.emit("worker_exit", rank=1, incarnation=3, exit_code=None, signal=9, life=0)
    time.sleep(0.02)
    r0.emit("epoch", epoch=2, members=[0, 1], step=8)
    r0.emit("commit", epoch=2, step=8)
    _close(agent, r0)
    (f,) = summarize(tmp_path)["faults"]
    assert f["recover_ms"] >= 20, f


def test_a_step_retried_in_its_own_epoch_is_the_recovery(tmp_path):
    """A one-worker job's exception: the step rolls back and is retried in its epoch."""
    (r0,) = _logs(tmp_path, "rank 0")
    r0.emit("commit", epoch=1, step=2)
    r0.emit("local_fault", step=3, epoch=1, cause="RuntimeError: boom", incarnation=1)
    r0.emit("rollback", epoch=1, step=3, reason="local")
    r0.emit("commit", epoch=1, step=3)
    time.sleep(0.05)
    r0.emit("commit", epoch=1, step=4)
    _close(r0)
    (f,) = summarize(tmp_path)["faults"]
    assert f["recovered"] and f["recover_ms"] < 40, f
