"""The staleness bound (issue 22, seed items b and c), real processes: a 2-stage toy
pipeline (fastft.demo.pipeline), each stage its own fastft job of 2 replicas, stage 0
sending its features to stage 1 through the flow store, ``--max-ahead 2``. Stage 1 is the
slower one, so stage 0 is held at the bound most of the time. Under SIGKILLs and
exceptions in both stages, at every commit of either stage (read from both event logs
on the machine's one monotonic clock):
- stage 0 has committed at most 2 steps more than stage 1 (the bound, c);
- stage 1 has committed no step that stage 0 has not (the data-flow order, b);
and every stage ends bitwise equal to its fault-free run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import check_s1_s3, finals

from fastft.runtime import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 24
AHEAD = 2
FASTFT = [sys.executable, "-m", "fastft.cli"]


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    """A flow store (``fastft store``) and a job secret the two stages share."""
    d = tmp_path_factory.mktemp("flow")
    secret = d / "pipe.secret"
    subprocess.run([*FASTFT, "secret", "new", str(secret)], check=True, timeout=60)
    store = subprocess.Popen(
        [*FASTFT, "store", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True
    )
    try:
        address = store.stdout.readline().strip()  # type: ignore[union-attr]
        assert address.startswith("127.0.0.1:"), address
        yield address, secret
    finally:
        store.terminate()
        store.wait(30)


def run_pipeline(tmp: Path, name: str, flow, plans: dict[int, list[dict]]) -> list[Path]:
    address, secret = flow
    procs, runs = [], []
    for stage in (0, 1):
        run = tmp / f"{name}-s{stage}"
        run.mkdir(parents=True)
        cmd = [*FASTFT, "run", "--nproc", "2", "--job", f"{name}-s{stage}", "--run-dir", str(run)]
        cmd += ["--stage", f"{stage}/2", "--flow", address, "--flow-name", name]
        cmd += ["--max-ahead", str(AHEAD), "--job-secret-file", str(secret), "--check-every", "1"]
        if plans.get(stage):
            (run / "plan.json").write_text(json.dumps({"faults": plans[stage]}))
            cmd += ["--inject", str(run / "plan.json")]
        cmd += [
            "-m",
            "fastft.demo.pipeline",
            "--",
            "--steps",
            str(STEPS),
            "--out",
            str(run / "out"),
        ]
        if stage == 1:
            cmd += ["--step-time", "0.05"]  # the slower stage: stage 0 meets the bound
        log = open(run / "launcher.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        runs.append(run)
    try:
        for (p, _), run in zip(procs, runs, strict=True):
            rc = p.wait(timeout=200)
            assert rc == 0, (run / "launcher.log").read_text()[-3000:]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()  # (its agent takes its workers down with it)
                p.wait(30)
            log.close()
    return runs


def check_bound(runs: list[Path]) -> int:
    """(b) and (c) at every commit of either stage; returns how often stage 0 was held."""
    ev = []
    for stage, run in enumerate(runs):
        ev += [(e["mono"], stage, e) for e in read_events(run)]
    ev.sort(key=lambda t: t[0])
    committed = [0, 0]  # steps each stage has committed (its members' commit events so far)
    for _, stage, e in ev:
        if e["event"] != "commit":
            continue
        committed[stage] = max(committed[stage], e["step"] + 1)
        c0, c1 = committed
        assert c0 - c1 <= AHEAD, f"stage 0 committed step {c0 - 1}, {c0 - c1} ahead of stage 1"
        assert c1 <= c0, f"stage 1 committed step {c1 - 1} before stage 0 did"
    return sum(1 for _, stage, e in ev if stage == 0 and e["event"] == "held")


@pytest.fixture(scope="module")
def pipeline_clean(tmp_path_factory, flow) -> list[dict[int, dict]]:
    runs = run_pipeline(tmp_path_factory.mktemp("pipe"), "clean", flow, {})
    for run in runs:
        check_s1_s3(run, STEPS)
    assert check_bound(runs) > 0  # stage 0 met the bound: the test exercises the hold
    return [finals(run) for run in runs]


def test_the_bound_and_the_data_flow_order_hold_at_every_commit_under_faults(
    tmp_path, flow, pipeline_clean
):
    plans = {
        0: [
            {"kind": "sigkill", "rank": 1, "at_step": 12},  # stage 1 then waits for it
            {"kind": "exception", "rank": 0, "at_step": 17},
        ],
        1: [
            {"kind": "sigkill", "rank": 0, "at_step": 6},  # stage 0 is held meanwhile
            {"kind": "exception", "rank": 1, "at_step": 15},
        ],
    }
    runs = run_pipeline(tmp_path, "faults", flow, plans)
    for run in runs:
        check_s1_s3(run, STEPS)
    assert check_bound(runs) > 0
    for stage, run in enumerate(runs):
        ev = read_events(run)
        assert {e["step"] for e in ev if e["event"] == "rollback"} >= {
            e["at_step"] for e in plans[stage]
        }
        got = {r: v["digest"] for r, v in finals(run).items()}
        assert got == {r: v["digest"] for r, v in pipeline_clean[stage].items()}, stage
