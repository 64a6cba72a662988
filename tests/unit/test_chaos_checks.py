"""The chaos soak's history check (``bench/_chaos_checks.check``, S1): each stretch of a
worker's commits is contiguous, and a stretch that begins with a fetched heal begins at
the healed step (a member that rolled a step back while the others committed it heals
forward: that gap is the heal's, not a skipped step)."""

from __future__ import annotations

import sys
from pathlib import Path

from fastft.process.events import EventLog

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _chaos_checks import check  # noqa: E402


def _history(tmp_path, rank2_heal_step, rank2_after):
    """Ranks 1 and 2 commit steps 0-2; rank 2 then rolls step 3 back (rank 1 commits
    it), fetches a heal to ``rank2_heal_step`` and commits ``rank2_after``."""
    r1, r2 = EventLog(tmp_path, "rank 1"), EventLog(tmp_path, "rank 2")
    for log in (r1, r2):
        log.emit("worker_start", life=0, incarnation=1)
    for s in range(3):
        r1.emit("commit", epoch=1, step=s)
        r2.emit("commit", epoch=1, step=s)
    r2.emit("rollback", epoch=1, step=3, reason="rank 0 exited (signal 9)")
    r1.emit("commit", epoch=1, step=3)
    if rank2_heal_step is not None:
        r2.emit("heal", epoch=2, step=rank2_heal_step, role="fetch")
    for s in range(4, 6):
        r1.emit("commit", epoch=2, step=s)
    for s in rank2_after:
        r2.emit("commit", epoch=2, step=s)
    r1.close()
    r2.close()
    return check(tmp_path, {}, 6)["applied_twice_or_skipped"]


def test_a_gap_healed_forward_is_the_heals(tmp_path):
    assert _history(tmp_path, 4, [4, 5]) == []


def test_a_gap_without_a_heal_is_a_skipped_step(tmp_path):
    (bad,) = _history(tmp_path, None, [4, 5])
    assert bad.startswith("rank 2 life 0") and "[0, 1, 2, 4, 5]" in bad, bad


def test_a_stretch_that_does_not_begin_at_its_heal_is_a_skipped_step(tmp_path):
    (bad,) = _history(tmp_path, 4, [5])
    assert "healed to 4" in bad and bad.endswith("[5]"), bad
