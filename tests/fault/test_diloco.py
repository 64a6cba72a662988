"""``--sync diloco:4`` (issue 22), real processes. The groups take local steps with their
own Adam; on entering steps 4, 8, ... the pseudo-gradients (anchor - parameters) are
averaged and an outer Nesterov SGD steps the anchor, which every group continues from.
The outer step belongs to the transaction of the step it begins (docs/hsdp.md):
- an exception rolls back only its step, the outer step with it, and the run ends
  bitwise equal to the fault-free run of the policy;
- a lost group heals a survivor's current state: its own local steps since the last outer
  step are gone, the survivors' are untouched (bitwise), and the anchor is never lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from _runs import check_s1_s3, fastft_run, finals

from fastft.runtime import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DILOCO = ("--sync", "diloco:4")  # outer steps on entering 4, 8, ..., 28
STEPS = 32


def commits(run: Path) -> dict[tuple[str, int], dict]:
    """The last commit event of each (worker, step)."""
    return {(e["src"], e["step"]): e for e in read_events(run) if e["event"] == "commit"}


def check_outer(run: Path, shard_size: int = 1) -> None:
    """S3 of the outer state: every member of a shard index holds the same anchor and
    outer optimizer after every commit; it changes at the outer steps only."""
    by_step: dict[tuple[int, int], set[str]] = {}
    for (src, step), e in commits(run).items():
        index = int(src.split()[1]) % shard_size
        by_step.setdefault((step, index), set()).add(e["outer"])
    for (step, index), got in sorted(by_step.items()):
        assert len(got) == 1, f"the groups' anchors differ after step {step}: {got}"
        if step and step % 4:  # a step inside a window leaves the anchor as it was
            assert got == by_step[(step - 1, index)], step


def test_diloco_exceptions_at_and_after_an_outer_step_lose_nothing(tmp_path):
    """One worker per replica, 3 replicas. The exception at step 8 comes after that step's
    outer step was applied on every replica: the rollback undoes it and the retry does it
    again from the same state; the one at step 10 is inside a window."""
    clean = fastft_run(tmp_path, "diloco-clean", *DILOCO, steps=STEPS)
    check_s1_s3(clean, STEPS, sync_every=STEPS + 1)  # (S1; the parameters are each group's)
    check_outer(clean)
    c = commits(clean)
    assert c[("rank 0", 3)]["outer"] == c[("rank 0", 0)]["outer"] != c[("rank 0", 4)]["outer"]
    assert c[("rank 0", 5)]["digest"] != c[("rank 1", 5)]["digest"]  # local steps
    plan = [
        {"kind": "exception", "rank": 1, "at_step": 8},
        {"kind": "exception", "rank": 2, "at_step": 10},
    ]
    run = fastft_run(tmp_path, "diloco-exc", *DILOCO, plan=plan, steps=STEPS)
    check_s1_s3(run, STEPS, sync_every=STEPS + 1)
    check_outer(run)
    ev = read_events(run)
    assert {e["step"] for e in ev if e["event"] == "rollback"} >= {8, 10}
    assert {r: v["digest"] for r, v in finals(run).items()} == {
        r: v["digest"] for r, v in finals(clean).items()
    }


def test_diloco_a_lost_shard_group_takes_a_survivors_window_and_keeps_the_anchor(tmp_path):
    """2 groups x 2 shards; rank 1 is killed at step 10, inside the window 8-11. Group 1
    (ranks 2, 3) keeps its local steps: its commits are bitwise the fault-free run's up to
    the next outer step. Group 0 restarts and heals group 1's state of step 9, shard to
    shard; the anchor is the same in both, so the outer state is the fault-free one's up
    to step 11 too. From the outer step at 12 on the run differs, as the docs say: it
    averages group 0's moves from group 1's state."""
    hsdp = ("--shard-size", "2", *DILOCO)
    clean = fastft_run(tmp_path, "diloco-hsdp-clean", *hsdp, nproc=4, steps=STEPS)
    check_outer(clean, shard_size=2)
    plan = [{"kind": "sigkill", "rank": 1, "at_step": 10}]
    run = fastft_run(tmp_path, "diloco-hsdp-10", *hsdp, plan=plan, nproc=4, steps=STEPS)
    check_s1_s3(run, STEPS, shard_size=2, sync_every=STEPS + 1)
    check_outer(run, shard_size=2)
    ev = read_events(run)
    fetched = [e for e in ev if e["event"] == "heal" and e["role"] == "fetch" and e["step"]]
    assert sorted((e["src"], e["step"]) for e in fetched) == [("rank 0", 10), ("rank 1", 10)]
    c, f = commits(clean), commits(run)
    for step in range(12):
        for src in ("rank 2", "rank 3"):
            assert f[(src, step)]["digest"] == c[(src, step)]["digest"], (src, step)
        assert f[("rank 0", step)]["outer"] == c[("rank 0", step)]["outer"], step
    assert f[("rank 2", 12)]["outer"] != c[("rank 2", 12)]["outer"]
