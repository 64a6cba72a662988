"""Every member draws the same global batch each step, whatever the loader's settings
(issue 40, item 1): a torchdata ``StatefulDataLoader`` with ``num_workers=0`` restored
from any state reshuffled its next pass differently from one never restored, so ranks
trained on different batches from the second pass on. Fault-free and with a SIGKILL
(the restarted member is healed, its loader set from a peer's state), with 0 and 2 loader
workers: each step's batch is the same on every member, every sample counts once per pass,
and the run ends bitwise equal to the fault-free one. And samples perturbed per rank
(a user's mistake) stop the job at the batch check, exit 1 with the reason."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from _runs import stateful_run

pytest.importorskip("torchdata")
pytestmark = pytest.mark.timeout(240)

STEPS, BATCH, SAMPLES = 24, 24, 120  # nearly five passes over the dataset


def _run(tmp: Path, name: str, *args: str, plan: list[dict] | None = None) -> tuple[Path, int]:
    data = (STEPS, BATCH, SAMPLES)
    return stateful_run(tmp, name, nproc=2, data=data, plan=plan, script=args, timeout=200)


def _batches(run: Path) -> dict[int, dict[int, list[int]]]:
    """Step -> rank -> the global batch that member drew in the step's commit."""
    out: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for f in sorted((run / "samples").glob("rank*.jsonl")):
        rank = int(f.name.split("-")[0].removeprefix("rank"))
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[r["step"]][rank] = r["batch"]
    return out


def _digests(run: Path) -> set[str]:
    return {json.loads(f.read_text())["digest"] for f in (run / "out").glob("final-rank*.json")}


@pytest.mark.parametrize(
    "workers",
    # (the slow tier: make test under its 10 minutes; tests/zoo's ResNet draws through
    # fastft.Batches with 2 loader workers there)
    [pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)],
)
def test_members_draw_the_same_batch_and_a_kill_changes_nothing(tmp_path, workers):
    args = ("--loader-workers", str(workers))
    clean, rc = _run(tmp_path, "clean", *args)
    assert rc == 0, (clean / "launcher.log").read_text()[-3000:]
    killed, rc = _run(
        tmp_path, "killed", *args, plan=[{"kind": "sigkill", "rank": 1, "at_step": 7}]
    )
    assert rc == 0, (killed / "launcher.log").read_text()[-3000:]
    want = _batches(clean)
    assert sorted(want) == list(range(STEPS))
    for run in (clean, killed):
        got = _batches(run)
        for step, by_rank in got.items():
            assert len({tuple(b) for b in by_rank.values()}) == 1, (
                f"{run.name}: step {step}: the members drew different batches {by_rank}"
            )
        for step in range(STEPS):  # (rank 1 logged nothing for the step it died in)
            assert step in got and want[step][0] in got[step].values(), (
                f"{run.name}: step {step} drew {got.get(step)}, the fault-free run {want[step][0]}"
            )
    drawn = [i for s in range(STEPS) for i in want[s][0]]
    for p in range(STEPS * BATCH // SAMPLES):  # every sample once per pass
        assert sorted(drawn[p * SAMPLES : (p + 1) * SAMPLES]) == list(range(SAMPLES))
    assert _digests(killed) == _digests(clean) and len(_digests(clean)) == 1


def test_batches_that_differ_by_rank_stop_the_job_with_the_reason(tmp_path):
    run, rc = _run(tmp_path, "per-rank", "--loader-workers", "0", "--augment-per-rank")
    log = (run / "launcher.log").read_text()
    assert rc == 1, log[-3000:]
    assert "drew different batches in step 0" in log, log[-3000:]
    assert not list((run / "samples").glob("*.jsonl")) or not any(
        f.read_text() for f in (run / "samples").glob("*.jsonl")
    ), "a step was committed with different batches"
