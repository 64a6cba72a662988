"""Gray failures (issue 50) on real workers: a straggler named and replaced, a flipped bit
caught by the replica check and repaired."""

from __future__ import annotations

import pytest
from _runs import check_s1_s3, fastft_run, finals

from fastft.protocol import EXIT_DRAINED
from fastft.report import render_report, summarize
from fastft.runtime import read_events

SLOW = [{"kind": "slow", "rank": 1, "at_step": 2, "arg": 4, "life": 0}]
"""Rank 1's first life computes 4x as long from step 2 on (its next life does not)."""


@pytest.mark.slow  # (~15 s each: make test stays under its 10 minutes on 2 cores)
def test_a_straggler_is_named_drained_and_replaced_with_nothing_rolled_back(tmp_path, clean):
    flags = ("--stragglers", "replace", "--warm-spares", "1")
    run = fastft_run(tmp_path, "slow", *flags, plan=SLOW, train=("--step-time", "0.02"))
    check_s1_s3(run)
    assert {v["digest"] for v in finals(run).values()} == {clean[0]["digest"]}
    ev = read_events(run)
    (named,) = [e for e in ev if e["event"] == "straggler"]
    assert named["rank"] == 1 and named["action"] == "replace" and named["ratio"] > 2, named
    exits = [(e["rank"], e["exit_code"]) for e in ev if e["event"] == "worker_exit"]
    assert (1, EXIT_DRAINED) in exits, exits  # it left after a commit: nothing rolled back
    assert not [e for e in ev if e["event"] == "rollback"]
    later = [e for e in ev if e["event"] == "spawn" and e["rank"] == 1 and e["life"] > 0]
    assert later and later[0]["warm"], later  # a warm spare took its place
    log = (run / "launcher.log").read_text()
    assert "fastft: straggler: rank 1 computes" in log and "asking it to drain" in log, log
    report = render_report(run, summarize(run))
    assert "stragglers (members every step waited for):" in report
    assert "rank 1 at step" in report and "drained and replaced" in report, report


@pytest.mark.slow
def test_a_straggler_is_only_reported_by_default(tmp_path, clean):
    run = fastft_run(tmp_path, "slow", plan=SLOW, train=("--step-time", "0.02"))
    check_s1_s3(run)
    assert {v["digest"] for v in finals(run).values()} == {clean[0]["digest"]}
    ev = read_events(run)
    assert [(e["rank"], e["action"]) for e in ev if e["event"] == "straggler"] == [(1, "report")]
    assert not [e for e in ev if e["event"] == "worker_exit" and e["exit_code"]]
    assert "--stragglers replace would replace it" in (run / "launcher.log").read_text()


@pytest.mark.slow
def test_a_flipped_bit_is_caught_and_the_corrupted_replica_heals_from_the_majority(tmp_path, clean):
    # the bit flips as step 10 begins, the step the replica check compares (every 5): the
    # corrupted parameter's gradient is rolled back with the step, so nothing of it is
    # committed and the job ends bitwise equal to the fault-free run
    plan = [{"kind": "bitflip", "rank": 1, "at_step": 10, "arg": 3}]
    run = fastft_run(tmp_path, "sdc", "--compare-every", "5", plan=plan)
    check_s1_s3(run)
    assert {v["digest"] for v in finals(run).values()} == {clean[0]["digest"]}
    ev = read_events(run)
    found = [e for e in ev if e["event"] == "replicas_diverged"]
    assert len(found) == 3, found  # every member saw it, and decided alike
    assert {(e["step"], tuple(e["minority"]), e["action"], tuple(e["items"])) for e in found} == {
        (10, (1,), "heal", ("parameters",))
    }, found
    heals = [e for e in ev if e["event"] == "heal" and e["role"] == "fetch" and e["step"] >= 10]
    assert [e["src"] for e in heals] == ["rank 1"], heals  # the corrupted one, from a peer
    sent = {
        e["src"] for e in ev if e["event"] == "heal" and e["role"] == "send" and e["step"] >= 10
    }
    assert sent and "rank 1" not in sent, sent  # never a heal source


@pytest.mark.slow
def test_two_replicas_that_differ_run_the_step_again_then_restore_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    plan = [{"kind": "bitflip", "rank": 1, "at_step": 12, "arg": 3}]
    flags = ("--compare-every", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5")
    run = fastft_run(tmp_path, "sdc2", *flags, plan=plan, nproc=2)
    ev = read_events(run)
    actions = sorted((e["step"], e["action"]) for e in ev if e["event"] == "replicas_diverged")
    assert actions == [(12, "restore")] * 2 + [(12, "retry")] * 2, actions
    assert [e for e in ev if e["event"] == "epoch" and e.get("restore") is not None], ev[-5:]
    assert len({v["digest"] for v in finals(run).values()}) == 1
