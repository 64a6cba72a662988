"""Hugging Face's Trainer under fastft (issue 62): examples/hf_trainer.py, a GPT-2 built
from a config with a dataset tokenized in the script and the usual ``TrainingArguments``
(accumulation, clipping, a cosine schedule with warmup, logging and checkpoints), written
as the Trainer's docs teach; the one line that changes is the Trainer's import. Under
``fastft run`` and fault plans, each rank's final state and log history are checked
bitwise against the fault-free run. ``make test-hf`` installs the ``hf`` extra and runs
this tier."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf_trainer.py"
STEPS = ("--steps", "16")  # (an epoch is 10 steps: the run crosses an epoch's end)
EVERY_KIND = [  # one fault of each kind, one between a commit's decision and its apply,
    # and one in the second epoch (the restarted worker skips into it)
    {"kind": "sigkill", "rank": 1, "at_step": 3, "life": 0},
    {"kind": "exception", "rank": 2, "at_step": 5, "life": 0},
    {"kind": "sigkill", "rank": 0, "at_step": 7, "life": 0, "point": "commit"},
    {"kind": "sigstop", "rank": 2, "at_step": 9, "life": 0},
    {"kind": "state_lost", "rank": 1, "at_step": 11, "life": 1},
    {"kind": "sigkill", "rank": 2, "at_step": 13, "life": 1},
]


def command(run: Path, *flags: str, plan: list[dict] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)]
    cmd += ["--job", run.name, *flags]
    if plan is not None:
        run.mkdir(parents=True, exist_ok=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    return [*cmd, str(SCRIPT), *STEPS, "--out", str(run / "out")]


def hf_run(tmp: Path, name: str, *flags: str, plan: list[dict] | None = None) -> Path:
    run = tmp / name
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "launcher.log", "w") as log:
        p = subprocess.run(
            command(run, *flags, plan=plan),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=420,
            cwd=tmp,
        )
    assert p.returncode == 0, (run / "launcher.log").read_text()[-5000:]
    return run


def same_everywhere(run: Path) -> dict:
    got = {
        int(f.stem.removeprefix("final-rank")): json.loads(f.read_text())
        for f in (run / "out").glob("final-rank*.json")
    }
    assert sorted(got) == [0, 1, 2], got
    assert all(r == got[0] for r in got.values()), got
    return got[0]


def checkpoint(run: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run / "out" / "checkpoints" / f"checkpoint-{step}"
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == step
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = hf_run(tmp_path_factory.mktemp("clean"), "clean")
    final = same_everywhere(run)
    assert final["global_step"] == 16 and len(final["losses"]) == 8  # (logged every 2 steps)
    return run


def test_the_trainer_through_every_fault_kind_ends_bitwise_equal(tmp_path, clean):
    """SIGKILLs (one between a commit's decision and its apply, one in the second epoch),
    an exception, a SIGSTOP and a lost state: every rank ends with the fault-free run's
    model, AdamW state and schedule, and the same logged losses; the checkpoints rank 0
    saved (save_steps=8) hold the fault-free weights."""
    run = hf_run(tmp_path, "faults", plan=EVERY_KIND)
    assert same_everywhere(run) == same_everywhere(clean)
    ev = read_events(run)
    assert any(e["event"] == "rollback" for e in ev) and any(e["event"] == "heal" for e in ev)
    spawned = {(e["rank"], e["life"]) for e in ev if e["event"] == "spawn"}
    assert {(0, 1), (1, 1), (2, 1), (2, 2)} <= spawned, spawned
    for step in (8, 16):
        want, got = checkpoint(clean, step), checkpoint(run, step)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), step


def test_a_drained_worker_and_warm_spares_leave_the_result_exact(tmp_path, clean):
    """Rank 1 asked to leave (a SIGTERM: it drains after its next commit, nothing rolled
    back) and rank 2 SIGKILLed later, with a warm spare that runs the script ahead
    (--spare-run-ahead): the first next life is a spare that already built its model and
    Trainer, waiting with no rank yet in fastft.init(), healed there; bitwise equal to the
    fault-free run."""
    plan = [
        {"kind": "sigterm", "rank": 1, "at_step": 4, "life": 0},
        {"kind": "sigkill", "rank": 2, "at_step": 11, "life": 0},
    ]
    run = hf_run(tmp_path, "spares", "--warm-spares", "1", "--spare-run-ahead", plan=plan)
    assert same_everywhere(run) == same_everywhere(clean)
    ev = read_events(run)
    drained = [e for e in ev if e["event"] == "drained"]
    assert drained and drained[0]["src"] == "rank 1", drained
    later = [e for e in ev if e["event"] == "spawn" and e["life"] > 0]
    assert {e["rank"] for e in later} == {1, 2} and later[0]["warm"], later


def test_a_preempted_trainer_resumes_from_the_durable_tier_exactly(tmp_path, clean):
    """SIGTERM to the agent after step 5: every rank drains at a commit (exit 143), the
    durable tier holds the state with the TrainerState, and the same command resumes it
    mid-epoch: bitwise equal, the same log history."""
    ck = tmp_path / "ck"
    flags = ("--checkpoint-dir", str(ck), "--checkpoint-every", "1000")
    run = tmp_path / "preempted"
    run.mkdir()
    # (every rank's steps from step 5 on compute 20x as long, a pace and nothing else: the
    # SIGTERM comes before the 16 steps' end, 0.37 s after step 5 here otherwise)
    pace = [{"kind": "slow", "rank": r, "at_step": 5, "arg": 20} for r in range(3)]
    with open(tmp_path / "preempted.log", "w") as log:
        p = subprocess.Popen(
            command(run, *flags, plan=pace), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path
        )
        try:
            deadline = time.monotonic() + 240
            while not (run / "events.jsonl").exists() or not any(
                e["event"] == "commit" and e["step"] >= 5 for e in read_events(run)
            ):
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == 143, (tmp_path / "preempted.log").read_text()[-4000:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    resumed = hf_run(tmp_path, "preempted", *flags)
    starts = [e for e in read_events(resumed) if e["event"] == "restore"]
    assert starts and 5 <= starts[-1]["step"] < 16, starts
    assert same_everywhere(resumed) == same_everywhere(clean)
