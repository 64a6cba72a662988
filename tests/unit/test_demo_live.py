"""The demo's live view folds the event log into each worker's phase, step and faults."""

from __future__ import annotations

from rich.console import Console

from fastft.demo.live import LiveState
from fastft.runtime import EventLog


def test_live_view_follows_the_event_log(tmp_path):
    agent, r0, r1 = (EventLog(tmp_path, s) for s in ("agent 0", "rank 0", "rank 1"))
    state = LiveState(tmp_path, "demo")
    state.poll()  # nothing written yet
    assert state.workers == {}
    for r in (0, 1):
        agent.emit("spawn", rank=r, life=0, pid=100 + r, incarnation=r + 7)
    r0.emit("epoch", epoch=1, members=[0, 1], step=0, needs_state=[1], source=0, form_ms=1.0)
    r0.emit("phase", frm="INIT", to="HEALING", epoch=1, step=0, on="QuorumReady", reason=None)
    r0.emit("phase", frm="HEALING", to="NORMAL", epoch=1, step=0, on="HealDone", reason=None)
    for s in range(3):
        r0.emit("commit", epoch=1, step=s, digest=None, shard=None)
        r1.emit("commit", epoch=1, step=s, digest=None, shard=None)
    r1.emit("injected", kind="sigkill", step=3, epoch=1, incarnation=8)
    agent.emit("worker_exit", rank=1, incarnation=8, exit_code=None, signal=9, life=0)
    state.poll()
    assert (state.workers[0].phase, state.workers[0].step, state.workers[0].epoch) == (
        "NORMAL",
        3,
        1,
    )
    assert state.workers[1].phase == "DEAD"
    assert len(state.faults) == 2 and "injected sigkill into rank 1" in state.faults[0]
    agent.emit("spawn", rank=1, life=1, pid=200, incarnation=9)
    state.poll()  # starting: what it does, and for how long
    starting = Console(record=True, width=160)
    starting.print(state.render())
    assert "starting Python, importing torch and the script (" in starting.export_text()
    r1.emit("worker_start", incarnation=9, life=1, pid=200)
    state.poll()
    assert state.workers[1].starting.startswith("fastft.init(): ")
    r1.emit("heal", epoch=2, step=3, role="fetch", bytes=1000, heal_ms=4.0)
    state.poll()
    w = state.workers[1]
    assert (w.phase, w.life) == ("INIT", 1) and "healed at step 3" in w.last
    console = Console(record=True, width=120)
    console.print(state.render())
    text = console.export_text()
    assert "rank 1 exited (signal 9)" in text and "NORMAL" in text
    for log in (agent, r0, r1):
        log.close()


def test_untiled_steps_finds_a_gap_an_overlap_and_a_missing_end():
    from fastft.report import shards_by_step, untiled_steps

    def commit(step, lo, hi, n=6):
        return {"event": "commit", "step": step, "shard": [lo, hi, n]}

    ev = [commit(0, 0, 3), commit(0, 3, 6)]  # tiles
    ev += [commit(1, 0, 2), commit(1, 3, 6)]  # a gap
    ev += [commit(2, 0, 4), commit(2, 3, 6)]  # an overlap
    ev += [commit(3, 0, 3)]  # half the batch never consumed
    ev += [{"event": "commit", "step": 4, "shard": None}]  # no shards: not counted
    shards = shards_by_step(ev)
    assert sorted(shards) == [0, 1, 2, 3]
    assert untiled_steps(shards) == [1, 2, 3]


def test_a_member_that_voted_then_died_counts_only_where_that_is_what_happened():
    """A commit needs every member's vote: a member of the epoch that died before logging
    the step after its last logged commit had its gradient in that step (found by the
    chaos soak: a segfault in the bus thread right after the vote). One alive, or missing
    further on, stays missing."""
    from fastft.report import shards_by_step, unlogged_commits, untiled_steps

    def commit(src, step, lo, hi, epoch=1):
        return {"event": "commit", "src": src, "epoch": epoch, "step": step, "shard": [lo, hi, 6]}

    epoch = {"event": "epoch", "epoch": 1, "members": [0, 1], "incarnations": [10, 11]}
    ev = [epoch, commit("rank 0", 0, 0, 3), commit("rank 1", 0, 3, 6)]
    ev += [commit("rank 0", 1, 0, 3), commit("rank 0", 2, 0, 3)]  # rank 1 logs no more
    assert untiled_steps(shards_by_step(ev)) == [1, 2]
    assert unlogged_commits(ev) == []  # rank 1 alive: missing for real
    ev.append({"event": "worker_exit", "incarnation": 11})
    (got,) = unlogged_commits(ev)
    assert (got["src"], got["step"], got["shard"]) == ("rank 1", 1, [3, 6, 6])
    assert untiled_steps(shards_by_step([*ev, got])) == [2]  # not two steps after it


def test_a_member_that_voted_then_died_after_a_retry_gets_the_shard_it_had():
    """Found by the 600 s elastic soak (a false `untiled step 1010`): rank 2's last logged
    commit was the retry of a shrunken step (its shard plus a kept part), it voted for the
    next step and segfaulted before logging it. Its shard there is a plain tile of the
    epoch, not the retry's: computed as the runtime computes it."""
    from fastft.report import shards_by_step, unlogged_commits, untiled_steps
    from fastft.report.shards import member_shard

    def commit(src, step, lo, hi, kept=None):
        c = {"event": "commit", "src": src, "epoch": 53, "step": step, "shard": [lo, hi, 96]}
        return {**c, "kept": kept}

    epoch = {
        "event": "epoch",
        "epoch": 53,
        "members": [0, 2, 3],
        "incarnations": [10, 12, 13],
        "step": 1009,  # its first step retries 1009: rank 1's quarter is split three ways
        "kept": [[0, 0, 24, 96], [2, 48, 72, 96], [3, 72, 96, 96]],
    }
    ev = [
        epoch,
        commit("rank 0", 1009, 24, 32, [0, 24, 96]),
        commit("rank 3", 1009, 40, 48, [72, 96, 96]),
        commit("rank 2", 1009, 32, 40, [48, 72, 96]),
        commit("rank 3", 1010, 64, 96),
        commit("rank 0", 1010, 0, 32),
        {"event": "worker_exit", "incarnation": 12},
    ]
    assert untiled_steps(shards_by_step(ev)) == [1010]
    (got,) = unlogged_commits(ev)
    assert (got["src"], got["step"], got["shard"], got["kept"]) == (
        "rank 2",
        1010,
        [32, 64, 96],
        None,
    )
    assert untiled_steps(shards_by_step([*ev, got])) == []
    # the epoch's first step: the plan of the retry, each kept part with its holder
    assert member_shard(epoch, 1009, 96, 1) == {"shard": [32, 40, 96], "kept": [48, 72, 96]}
    assert member_shard({**epoch, "kept": None}, 1009, 96, 1) == {
        "shard": [32, 64, 96],
        "kept": None,
    }


def test_the_demo_plan_gives_every_kind_on_fewer_workers_in_the_right_lives():
    from fastft.demo.main import _plan

    four = _plan(200, 4)
    assert [(f["kind"], f["rank"], f["life"]) for f in four] == [
        ("exception", 1, 0),
        ("sigkill", 2, 0),
        ("sigstop", 3, 0),
        ("sigkill", 0, 0),
    ]
    two = _plan(200, 2)  # a kill ends a life: the rank's next fault is for its next life
    assert [(f["kind"], f["rank"], f["life"]) for f in two] == [
        ("exception", 1, 0),
        ("sigkill", 0, 0),
        ("sigstop", 1, 0),
        ("sigkill", 0, 1),
    ]


def test_two_injections_in_one_life_are_two_faults_in_the_report(tmp_path):
    from fastft.report import summarize

    agent, r0, r1 = (EventLog(tmp_path, s) for s in ("agent 0", "rank 0", "rank 1"))
    r1.emit("injected", kind="exception", step=8, epoch=1, incarnation=5)
    r1.emit("local_fault", step=8, epoch=1, cause="boom", incarnation=5)
    r0.emit("commit", epoch=2, step=8)
    r1.emit("injected", kind="sigstop", step=9, epoch=2, incarnation=5)  # 0.1 s later, say
    agent.emit("worker_stopped", rank=1, incarnation=5)
    r0.emit("commit", epoch=3, step=9)
    for log in (agent, r0, r1):
        log.close()
    faults = summarize(tmp_path)["faults"]
    assert [(f["rank"], f["kind"], f["step"]) for f in faults] == [
        (1, "exception", 8),
        (1, "sigstop", 9),
    ]
    assert faults[0]["seen_as"] == ["injected", "local_fault"]
    assert faults[1]["seen_as"] == ["injected", "worker_stopped"]
