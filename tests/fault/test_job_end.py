"""How a job ends: `fastft run` with 3 Gloo workers on CPU, faults at its last steps."""

from __future__ import annotations

import pytest
from _runs import STEPS, check_s1_s3, fastft_run, finals

from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("world", ["elastic", pytest.param("fixed", marks=pytest.mark.slow)])
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
