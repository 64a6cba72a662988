"""In-process restart, health checks before (re)joining, and repeat offenders (issue 23):
3 Gloo workers on CPU under `fastft run`, training the demo's model under ``ft.run``
(tests/fault/_restart_train.py), with S1, S3 and S5 held against the clean run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import STEPS, check_s1_s3

from fastft.protocol.exits import EXIT_UNHEALTHY
from fastft.runtime import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).parent / "_restart_train.py"


def run_job(tmp: Path, name: str, *flags: str, train: tuple[str, ...] = (), rc: int | None = 0):
    run = tmp / name
    run.mkdir(parents=True)
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)),
        *("--check-every", "1", "--job", name, *flags, str(SCRIPT), "--"),
        *("--steps", str(STEPS), "--out", str(run / "out"), *train),
    ]
    with open(run / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=200)
    out = (run / "launcher.log").read_text()
    assert rc is None or p.returncode == rc, out[-3000:]
    return run, p.returncode, out


def finals(run: Path) -> dict[int, dict]:
    return {
        int(f.stem.split("rank")[1]): json.loads(f.read_text())
        for f in (run / "out").glob("final-rank*.json")
    }


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run) if e["event"] == kind]


def test_an_exception_between_steps_restarts_the_loop_in_process_and_heals(tmp_path, clean):
    """Rank 1 damages its model and raises outside any transaction twice: each time it
    restarts its loop in the same process (no new pid, no re-import), heals the damage
    from a peer, and the job ends bitwise equal to the clean run. Every hook ran."""
    run, _, _ = run_job(tmp_path, "inproc", train=("--raise-at", "5,12"))
    check_s1_s3(run)
    f = finals(run)
    assert {r: v["digest"] for r, v in f.items()} == {r: clean[r]["digest"] for r in clean}
    assert len(events(run, "spawn")) == 3  # nothing started again
    restarts = events(run, "restarted_in_process")
    assert [(e["src"], e["fault_step"], e["healed"]) for e in restarts] == [
        ("rank 1", 6, True),
        ("rank 1", 13, True),
    ]
    assert f[1]["train"] == 3 and f[1]["on_fault"] == 2 and f[1]["before_restart"] == 2
    assert f[1]["health"] == 2 and f[1]["finalize"] == 1
    assert f[0]["train"] == 1 and f[0]["on_fault"] == 0 and f[0]["finalize"] == 1
    # the survivors rolled back at most the step the restart left; nobody was restarted
    assert not events(run, "restart")
    assert [e["exit_code"] for e in events(run, "worker_exit")] == [0, 0, 0]


@pytest.mark.parametrize("stagger", ["0", "0.01"])
def test_an_evaluation_that_raises_on_every_rank_restarts_each_in_process(tmp_path, clean, stagger):
    """Every rank raises after the same commit (an evaluation that fails everywhere): each
    state is suspect, none lost. They were each declared lost, so nobody held the state
    and the job failed ("every holder of the committed state was lost"); now the lowest
    suspect serves, the others heal from it, and the job ends as the clean run.

    Staggered (rank R raises R x 10 ms later), a rank raises as the next epoch forms, or
    in it. Such a fault rolled back the epoch being left, which nobody else did: it
    declared its live peers dead after 5 s and the agent killed them (CI, unstaggered,
    once in a few runs; docs/simulation.md, defect 6)."""
    train = ("--rank", "-1", "--raise-at", "9", "--no-damage", "--stagger", stagger)
    run, _, _ = run_job(tmp_path, "eval", train=train)
    check_s1_s3(run)
    f = finals(run)
    assert {r: v["digest"] for r, v in f.items()} == {r: clean[r]["digest"] for r in clean}
    kinds = ("restarted_in_process", "local_fault", "local_fault_superseded", "rollback")
    kinds += ("epoch", "heal", "fault_again", "declare_dead", "restart")
    story = "\n".join(  # (said when it fails)
        f"{e['src']} {e['event']} epoch {e.get('epoch')} step {e.get('step')} "
        f"{e.get('cause', e.get('reason', ''))}"
        for e in read_events(run)
        if e["event"] in kinds and (e.get("step") or 10) >= 9
    )
    restarted = sorted(e["src"] for e in events(run, "restarted_in_process"))
    assert restarted == ["rank 0", "rank 1", "rank 2"], story
    assert not events(run, "declare_dead"), story
    assert not events(run, "state_lost") and not events(run, "restart"), story
    assert [e["exit_code"] for e in events(run, "worker_exit")] == [0, 0, 0]


def test_a_soft_timeout_interrupts_a_stalled_loop_and_restarts_it(tmp_path, clean):
    """Rank 1 stops making progress after step 8 (Python that never reaches a step): the
    soft timeout prints its stacks and raises in it; the loop restarts in process."""
    run, _, out = run_job(tmp_path, "soft", train=("--hang-at", "8", "--soft", "1.5"))
    check_s1_s3(run)
    f = finals(run)
    assert {r: v["digest"] for r, v in f.items()} == {r: clean[r]["digest"] for r in clean}
    (soft,) = events(run, "soft_timeout")
    assert soft["src"] == "rank 1" and soft["timeout_s"] == 1.5
    assert "SoftTimeout" in out and "Thread" in out  # the restart's cause, the stacks
    assert [e["cause"].split(":")[0] for e in events(run, "restarted_in_process")] == [
        "SoftTimeout"
    ]
    assert len(events(run, "spawn")) == 3


def test_a_hard_timeout_kills_what_the_soft_one_cannot_interrupt(tmp_path, clean):
    """Rank 1 stalls with the interrupt signal blocked: the soft timeout cannot raise in
    it, the hard one kills it, its agent starts it again and it heals."""
    run, _, _ = run_job(
        tmp_path,
        "hard",
        train=("--hang-at", "8", "--uninterruptible", "--soft", "1", "--hard", "3"),
    )
    check_s1_s3(run)
    f = finals(run)
    assert {r: v["digest"] for r, v in f.items()} == {r: clean[r]["digest"] for r in clean}
    assert [e["src"] for e in events(run, "hard_timeout")] == ["rank 1"]
    (exit_,) = [e for e in events(run, "worker_exit") if e["exit_code"] != 0]
    assert exit_["rank"] == 1 and exit_["signal"] == 9
    assert len(events(run, "spawn")) == 4


def test_a_restarted_worker_that_fails_its_health_check_is_not_admitted(tmp_path):
    """Rank 1 is killed; its next life fails a health check. In a fixed world with no
    spare the job stops and says why; in an elastic one the world goes on without it."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "sigkill", "rank": 1, "at_step": 5}]}))
    flags = ("--inject", str(plan))
    train = ("--unhealthy", "life:1")
    run, rc, out = run_job(tmp_path, "fixed", *flags, train=train, rc=1)
    assert "rank 1 failed its health check" in out and "a bad device in life 1" in out
    assert "no warm spare can take its place" in out
    (failed,) = events(run, "health_failed")
    assert failed["src"] == "rank 1" and failed["check"] == "life"
    assert [e["exit_code"] for e in events(run, "worker_exit") if e["rank"] == 1] == [
        None,
        EXIT_UNHEALTHY,
    ]

    run, _, _ = run_job(tmp_path, "elastic", *flags, "--min-replicas", "2", train=train)
    (shrink,) = events(run, "world_shrinks")
    assert shrink["rank"] == 1 and "health check" in shrink["reason"]
    check_s1_s3(run)
    assert sorted(finals(run)) == [0, 2]


def test_a_warm_spare_that_fails_its_health_check_is_not_admitted(tmp_path):
    """The spare that takes rank 1's slot fails its health check: it never joins, and the
    elastic world goes on without the slot."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "sigkill", "rank": 1, "at_step": 5}]}))
    run, _, _ = run_job(
        tmp_path,
        "spare",
        *("--inject", str(plan), "--warm-spares", "1", "--min-replicas", "2"),
        train=("--unhealthy", "spare"),
    )
    assert [e["warm"] for e in events(run, "spawn") if e["rank"] == 1] == [False, True]
    (failed,) = events(run, "health_failed")
    assert failed["src"] == "rank 1" and failed["check"] == "spare"
    assert [e["rank"] for e in events(run, "world_shrinks")] == [1]
    check_s1_s3(run)
    assert sorted(finals(run)) == [0, 2]


def test_a_worker_that_raises_every_3_steps_is_quarantined(tmp_path):
    """Rank 1 raises between steps after every 3rd commit (restarted in process each
    time): at its 3rd fault within the window it is a repeat offender; it drains, and the
    elastic world goes on without it. `fastft report` lists it."""
    run, _, _ = run_job(
        tmp_path,
        "offender",
        *("--min-replicas", "2", "--quarantine", "3/600"),
        train=("--raise-every", "3"),
    )
    (q,) = events(run, "quarantined")
    assert q["rank"] == 1 and "3 times" in q["reason"]
    assert len(events(run, "restarted_in_process")) in (2, 3)  # (the 3rd may race the drain)
    assert [e["rank"] for e in events(run, "world_shrinks")] == [1]
    check_s1_s3(run)
    assert sorted(finals(run)) == [0, 2]
    rep = subprocess.run(
        [sys.executable, "-m", "fastft.cli", "report", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rep.returncode == 0, rep.stderr
    assert "repeat offenders" in rep.stdout and "rank 1" in rep.stdout, rep.stdout
