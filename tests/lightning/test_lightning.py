"""PyTorch Lightning under fastft (issue 62): an ordinary LightningModule, LightningDataModule
and Trainer (examples/lightning_classifier.py, written as Lightning's docs teach; the one
line that changes is ``strategy=FastFTStrategy()``) under ``fastft run`` and fault plans,
each rank's final state checked bitwise against the fault-free run. ``make
test-lightning`` installs the ``lightning`` extra and runs this tier."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "lightning_classifier.py"
HERE = Path(__file__).parent
STEPS = ("--steps", "24")  # (an epoch is 18 steps: the run crosses an epoch's end)
EVERY_KIND = [  # one fault of each kind, one between a commit's decision and its apply,
    # and one in the second epoch (a restarted worker's loader resumes mid-epoch)
    {"kind": "sigkill", "rank": 1, "at_step": 3, "life": 0},
    {"kind": "exception", "rank": 2, "at_step": 5, "life": 0},
    {"kind": "sigkill", "rank": 0, "at_step": 7, "life": 0, "point": "commit"},
    {"kind": "sigstop", "rank": 2, "at_step": 9, "life": 0},
    {"kind": "state_lost", "rank": 1, "at_step": 11, "life": 1},
    {"kind": "sigkill", "rank": 2, "at_step": 20, "life": 1},
]


def command(
    run: Path, *flags: str, plan: list[dict] | None = None, script: Path = SCRIPT
) -> list[str]:
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)]
    cmd += ["--job", run.name, *flags]
    if plan is not None:
        run.mkdir(parents=True, exist_ok=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    return [*cmd, str(script)]


def lightning_run(
    tmp: Path,
    name: str,
    *flags: str,
    args: tuple[str, ...] = STEPS,
    plan: list[dict] | None = None,
    expect: int = 0,
    script: Path = SCRIPT,
) -> Path:
    run = tmp / name
    run.mkdir(parents=True, exist_ok=True)
    cmd = [*command(run, *flags, plan=plan, script=script), *args, "--out", str(run / "out")]
    with open(run / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=420, cwd=tmp)
    text = (run / "launcher.log").read_text()
    assert p.returncode == expect, text[-5000:]
    return run


def finals(run: Path) -> dict[int, dict]:
    got = {
        int(f.stem.removeprefix("final-rank")): json.loads(f.read_text())
        for f in (run / "out").glob("final-rank*.json")
    }
    for r in got.values():
        r.pop("seconds")
    return got


def same_everywhere(run: Path) -> dict:
    got = finals(run)
    assert sorted(got) == [0, 1, 2], got
    assert all(r == got[0] for r in got.values()), got
    return got[0]


def checkpoint_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    (path,) = (run / "out" / "checkpoints").glob(f"*step={step}.ckpt")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == step and ckpt["optimizer_states"] and ckpt["lr_schedulers"]
    return ckpt["state_dict"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = lightning_run(tmp_path_factory.mktemp("clean"), "clean")
    assert same_everywhere(run)["global_step"] == 24
    return run


def test_a_lightning_module_through_every_fault_kind_ends_bitwise_equal(tmp_path, clean):
    """SIGKILLs (one between a commit's decision and its apply, one in the second epoch),
    an exception, a SIGSTOP and a lost state: every rank ends with the fault-free run's
    model, AdamW state and schedule; Lightning's ModelCheckpoint files (rank 0's, written
    by its second life after step 8) hold the fault-free weights, and its CSVLogger wrote
    the run's metrics."""
    run = lightning_run(tmp_path, "faults", plan=EVERY_KIND)
    assert same_everywhere(run) == same_everywhere(clean)
    ev = read_events(run)
    assert any(e["event"] == "rollback" for e in ev) and any(e["event"] == "heal" for e in ev)
    spawned = {(e["rank"], e["life"]) for e in ev if e["event"] == "spawn"}
    assert {(0, 1), (1, 1), (2, 1), (2, 2)} <= spawned, spawned  # (each came back, and healed)
    for step in (8, 16, 24):
        want, got = checkpoint_weights(clean, step), checkpoint_weights(run, step)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), step
    # every loss the fault-free run logged, logged with its value (rank 0's second life
    # writes a new version directory, as Lightning does whenever it resumes), but step
    # 7's: rank 0 died between its commit and the batch's end, where Lightning logs it
    missing = logged_losses(clean) - logged_losses(run)
    assert {step for step, _ in missing} <= {"7"}, missing


def logged_losses(run: Path) -> set[tuple[str, str]]:
    got = set()
    for f in (run / "out" / "logs").rglob("metrics.csv"):
        rows = [line.split(",") for line in f.read_text().splitlines()]
        if "train_loss" in rows[0]:
            at, col = rows[0].index("step"), rows[0].index("train_loss")
            got |= {(r[at], r[col]) for r in rows[1:] if r[col]}
    assert got or run.name == "faults", f"{run}: no train_loss logged"
    return got


def test_a_drained_worker_and_warm_spares_leave_the_result_exact(tmp_path, clean):
    """Rank 1 asked to leave (a SIGTERM: it drains after its next commit, nothing rolled
    back) and rank 2 SIGKILLed later, with a warm spare that runs the script ahead
    (--spare-run-ahead): the first next life is a spare that already built its model and
    Trainer, waiting with no rank yet in fastft.init(), healed there; bitwise equal to the
    fault-free run."""
    plan = [
        {"kind": "sigterm", "rank": 1, "at_step": 4, "life": 0},
        {"kind": "sigkill", "rank": 2, "at_step": 13, "life": 0},
    ]
    run = lightning_run(tmp_path, "spares", "--warm-spares", "1", "--spare-run-ahead", plan=plan)
    assert same_everywhere(run) == same_everywhere(clean)
    ev = read_events(run)
    drained = [e for e in ev if e["event"] == "drained"]
    assert drained and drained[0]["src"] == "rank 1", drained
    later = [e for e in ev if e["event"] == "spawn" and e["life"] > 0]
    assert {e["rank"] for e in later} == {1, 2} and later[0]["warm"], later


def test_a_preempted_lightning_job_resumes_from_the_durable_tier_exactly(tmp_path, clean):
    """SIGTERM to the agent after step 6: every rank drains at a commit, the durable tier
    holds the state with Lightning's loops (mid-epoch), and the same command resumes it:
    the loops, the loader's place and the schedule come back; bitwise equal."""
    ck = tmp_path / "ck"
    flags = ("--checkpoint-dir", str(ck), "--checkpoint-every", "1000")
    run = tmp_path / "preempted"
    # (every rank's steps from step 6 on compute 20x as long, a pace and nothing else: the
    # SIGTERM comes before the 24 steps' end, 0.41 s after step 6 here otherwise)
    pace = [{"kind": "slow", "rank": r, "at_step": 6, "arg": 20} for r in range(3)]
    cmd = [*command(run, *flags, plan=pace), *STEPS, "--out", str(run / "out")]
    with open(tmp_path / "preempted.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 240
            while not (run / "events.jsonl").exists() or not any(
                e["event"] == "commit" and e["step"] >= 6 for e in read_events(run)
            ):
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == 143, (tmp_path / "preempted.log").read_text()[-4000:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    resumed = lightning_run(tmp_path, "preempted", *flags)
    starts = [e for e in read_events(resumed) if e["event"] == "restore"]
    assert starts and 6 <= starts[-1]["step"] < 24, starts
    assert same_everywhere(resumed) == same_everywhere(clean)


def test_manual_optimization_is_refused_at_fit_saying_what_to_use(tmp_path):
    run = lightning_run(
        tmp_path, "manual", args=("--steps", "4"), expect=1, script=HERE / "manual.py"
    )
    log = (run / "launcher.log").read_text()
    assert "manual optimization (automatic_optimization = False) is not supported" in log, log[
        -3000:
    ]
    assert not any(e["event"] == "commit" for e in read_events(run))
