"""How a job ends: `fastft run` with 3 Gloo workers on CPU, faults at its last steps."""

from __future__ import annotations

import pytest
from _runs import STEPS, check_s1_s3, fastft_run, finals

from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["elastic", "fixed"])
def test_a_death_at_the_last_commit_ends_the_job(tmp_path, clean, world):
    """The last step is decided COMMIT and rank 2 dies before applying it: the survivors
    apply it, end their scripts in HEALING (the fault came after the decision) and must
    still tell the job's end to rank 2's restart, which otherwise waits to be admitted
    forever (it did, in both worlds, until the launcher's timeout)."""
    plan = [{"kind": "sigkill", "rank": 2, "at_step": STEPS - 1, "point": "commit"}]
    flags = ("--min-replicas", "2") if world == "elastic" else ()
    run = fastft_run(tmp_path, world, "--decide", "store", *flags, plan=plan, timeout=90)
    check_s1_s3(run)
    got = finals(run)
    assert {0, 1} <= set(got), got  # (the restart ends as it starts, without a final)
    assert {got[r]["digest"] for r in (0, 1)} == {clean[0]["digest"]}
    ev = read_events(run)
    assert any(e["event"] == "restart" and e["rank"] == 2 for e in ev)
    rank2 = [
        (e["life"], e["exit_code"]) for e in ev if e["event"] == "worker_exit" and e["rank"] == 2
    ]
    assert rank2 == [(0, None), (1, 0)], rank2  # (SIGKILLed; its restart ends as the job's)


@pytest.mark.slow  # (make test's 10 minutes: ~35 s)
def test_a_scripts_own_exit_status_is_its_failure_not_fastfts(tmp_path, clean):
    """A script that exits by itself with 93 (fastft's "script error") or 88 (fastft's
    "drained") gave neither reason: each is an ordinary failure of that worker, restarted
    and healed (before, the first failed the job with fastft's reason and the second passed
    for a drain). Every fault is one agent line, those a worker lives through included."""
    plan = [
        {"kind": "exit", "rank": 1, "at_step": 5, "life": 0, "arg": 93},
        {"kind": "exit", "rank": 2, "at_step": 12, "life": 0, "arg": 88},
        # and the faults a worker lives through: one agent line each too
        {"kind": "exception", "rank": 0, "at_step": 8, "life": 0},
        {"kind": "state_lost", "rank": 0, "at_step": 16, "life": 0},
    ]
    run = fastft_run(tmp_path, "own-status", plan=plan)
    check_s1_s3(run)
    assert {v["digest"] for v in finals(run).values()} == {clean[0]["digest"]}
    log = (run / "launcher.log").read_text()
    for rank, code in ((1, 93), (2, 88)):
        assert f"rank {rank}.0 exited with code {code} (the script's own status" in log, log
    lines = [x for x in log.splitlines() if x.startswith("fastft: fault: rank 0.0")]
    assert len(lines) == 2 and "raised in step 8" in lines[0], lines
    assert "lost its state in step 16" in lines[1], lines
    ev = read_events(run)
    assert [e["rank"] for e in ev if e["event"] == "restart"] == [1, 2]
    exits = [e for e in ev if e["event"] == "worker_exit" and e["exit_code"] in (88, 93)]
    assert len(exits) == 2 and all(e["ending"] is None for e in exits), exits


@pytest.mark.slow  # (~15 s)
def test_the_last_holder_of_the_state_drained_while_a_peer_heals_stays_until_it_has_it(tmp_path):
    """Two workers: rank 1 dies at step 5; rank 0, re-forming the epoch for its restart,
    gets a SIGTERM (a preemption notice) there. It holds the only copy of the state: it
    heals rank 1 first and leaves at its next commit (then, the world being fixed, starts
    again and heals from rank 1). Before, it left at once and took the state with it."""
    plan = [
        {"kind": "sigkill", "rank": 1, "at_step": 5, "life": 0},
        {"kind": "sigterm", "rank": 0, "at_step": 5, "life": 0, "point": "formation"},
    ]
    run = fastft_run(tmp_path, "last-holder", "--decide", "store", plan=plan, nproc=2)
    got = finals(run)
    assert sorted(got) == [0, 1] and len({v["digest"] for v in got.values()}) == 1, got
    ev = read_events(run)
    assert not any(e["event"] == "epoch" and "lost" in e for e in ev)
    healed = [e for e in ev if e["event"] == "epoch" and e["src"] == "rank 0" and e["step"] == 5]
    assert healed and healed[-1]["source"] == 0 and healed[-1]["needs_state"] == [1], healed
    assert [e["step"] for e in ev if e["event"] == "drained" and e["src"] == "rank 0"] == [6]
