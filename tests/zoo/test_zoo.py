"""The zoo (issue 47): scripts written the way users write them (tests/zoo/lm.py: a GPT
with AdamW, a warmup-cosine scheduler, clipping, dropout, a global loss, an EMA copy and
state of its own; tests/zoo/vision.py: a ResNet with BatchNorm, random augmentation in 2
loader workers, warmup + cosine, accumulation, clipping, bf16 autocast) under fault plans,
each checked bitwise against its own fault-free run and across ranks; and the in-band
replica check stopping a run whose replicas differ, naming what and where."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(600)

ZOO = Path(__file__).parent
EVERY_KIND = [  # one fault of each kind, and one between a commit's decision and its apply
    {"kind": "sigkill", "rank": 1, "at_step": 3, "life": 0},
    {"kind": "exception", "rank": 2, "at_step": 5, "life": 0},
    {"kind": "sigkill", "rank": 0, "at_step": 7, "life": 0, "point": "commit"},
    {"kind": "sigstop", "rank": 2, "at_step": 9, "life": 0},
    {"kind": "state_lost", "rank": 1, "at_step": 11, "life": 1},
]


def command(run: Path, script: str, *flags: str, plan: list[dict] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)]
    cmd += ["--job", run.name, *flags]
    if plan is not None:
        run.mkdir(parents=True, exist_ok=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    return cmd


def zoo_run(
    tmp: Path,
    name: str,
    script: str,
    *flags: str,
    args: tuple[str, ...] = (),
    plan: list[dict] | None = None,
    expect: int | None = 0,
) -> Path:
    run = tmp / name
    run.mkdir(parents=True, exist_ok=True)
    cmd = command(run, script, *flags, plan=plan)
    cmd += [str(ZOO / script), *args, "--out", str(run / "out")]
    with open(run / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=420)
    text = (run / "launcher.log").read_text()
    assert expect is None or p.returncode == expect, text[-4000:]
    (run / "rc").write_text(str(p.returncode))
    return run


def finals(run: Path) -> dict[int, dict]:
    return {
        int(f.stem.removeprefix("final-rank")): json.loads(f.read_text())
        for f in (run / "out").glob("final-rank*.json")
    }


def same_everywhere(run: Path, steps: int) -> dict:
    """Every rank's final record, equal across ranks (but for its own counts)."""
    got = finals(run)
    assert sorted(got) == [0, 1, 2], got
    strip = [
        {k: v for k, v in r.items() if k not in ("commits", "rollbacks")} for r in got.values()
    ]
    assert all(r == strip[0] for r in strip), json.dumps(got, indent=1)
    assert strip[0]["step"] == steps
    return strip[0]


def unplanned(run: Path) -> list[dict]:
    """The events a plan of exceptions alone should not bring (a restart, a heal of a
    member's state, a replica mismatch, a hang verdict), for a failing test's message."""
    kinds = {"spawn", "replicas_diverged", "hung", "hang", "exit", "worker_exit", "state_lost"}
    out = []
    for e in read_events(run):
        needs = e["event"] == "epoch" and e.get("needs_state") and e.get("step")
        if e["event"] in kinds or needs:
            out.append({k: v for k, v in e.items() if k not in ("t", "mono", "job")})
    return out


def faults_happened(run: Path) -> None:
    ev = read_events(run)
    assert any(e["event"] == "rollback" for e in ev), "the plan rolled nothing back"
    assert any(e["event"] == "heal" for e in ev), "the plan healed nothing"


# --- make test: one script through every fault kind, and the replica check ---------------
def test_the_gpt_through_every_fault_kind_ends_bitwise_equal_to_its_fault_free_run(tmp_path):
    """The scheduler, the EMA, the counters and the loss history included: a heal at the
    boundary after a death between a commit's decision and its apply once left the healed
    rank's scheduler one step behind (its peers' post-commit code had not run)."""
    args = ("--steps", "14")
    clean = same_everywhere(zoo_run(tmp_path, "clean", "lm.py", args=args), 14)
    run = zoo_run(tmp_path, "faults", "lm.py", args=args, plan=EVERY_KIND)
    assert same_everywhere(run, 14) == clean
    assert clean["last_epoch"] == 14 and clean["stats"]["steps"] == 14
    faults_happened(run)


def test_a_scheduler_left_out_of_register_fails_the_job_at_once_and_says_why(tmp_path):
    run = zoo_run(
        tmp_path, "forgot", "lm.py", args=("--steps", "4", "--forget-scheduler"), expect=1
    )
    log = (run / "launcher.log").read_text()
    assert "LambdaLR steps a registered optimizer but is not registered" in log
    assert not any(e["event"] == "commit" for e in read_events(run))


@pytest.mark.slow
def test_buffers_left_to_each_member_are_caught_by_the_replica_check(tmp_path):
    """BatchNorm's running statistics, each member's own (--buffers local, as fastft did
    before: DDP broadcasts rank 0's), differ after the first step: the check (in the
    first two steps of every epoch, then every --compare-every) names them."""
    flags = ("--buffers", "local")
    run = zoo_run(tmp_path, "local", "vision.py", *flags, args=("--steps", "5"), expect=1)
    log = (run / "launcher.log").read_text()
    assert "'buffers' differs" in log and "--buffers at average" in log, log[-3000:]
    (ev,) = {
        (e["step"], tuple(e["items"]))
        for e in read_events(run)
        if e["event"] == "replicas_diverged"
    }
    assert ev == (1, ("buffers",))  # (the epoch's second step: the first after a commit)


def test_the_resnets_replicas_are_equal_without_faults(tmp_path):
    """BatchNorm's statistics averaged with the gradients (DDP copies rank 0's): before,
    each member kept its own, and the same evaluation scored differently on each rank."""
    final = same_everywhere(zoo_run(tmp_path, "clean", "vision.py", args=("--steps", "6")), 6)
    assert final["last_epoch"] == 6


@pytest.mark.slow
def test_state_changed_on_one_member_is_the_scripts_and_stops_the_job(tmp_path):
    """A bug of the script's own (rank 2 nudges its EMA after step 4's commit): the next
    check, at step 5, names the item and the member; every member goes back to the last
    verified state and runs the steps again, the script nudges again, and the same item
    differs again at step 5: the script's doing, not a corrupted replica (a heal from the
    majority once hid it, every rank then off the job without the nudge): the workers end
    with exit 94, the job fails."""
    args = ("--steps", "8", "--perturb", "2:4")
    run = zoo_run(tmp_path, "nudged", "lm.py", "--compare-every", "5", args=args, expect=1)
    got = [e for e in read_events(run) if e["event"] == "replicas_diverged"]
    assert got and all(e["items"] == ["ema"] and e["minority"] == [2] for e in got), got
    assert {(e["step"], e["action"]) for e in got} == {(5, "rewind"), (5, "stop")}, got
    log = (run / "launcher.log").read_text()
    assert "'ema' differs on rank 2" in log and "differed again" in log, log[-3000:]
    assert "exited with code 94" in log, log[-3000:]


@pytest.mark.slow
def test_a_bit_the_device_flips_is_repaired_to_the_fault_free_run(tmp_path):
    """A bit of rank 1's parameter flips once after step 3 (the script's own flip, as a
    faulty device's), default flags: the check at step 40 finds it, every member goes back
    to the state of step 0, the last verified one, and runs the steps again; the corrupted
    member's gradients of steps 4-39 are in nobody's state: every rank ends bitwise equal
    to the fault-free run."""
    args = ("--steps", "42")
    clean = same_everywhere(zoo_run(tmp_path, "clean", "lm.py", args=args), 42)
    run = zoo_run(tmp_path, "flip", "lm.py", args=(*args, "--flip", "1:3"))
    assert same_everywhere(run, 42) == clean, unplanned(run)
    got = {
        (e["step"], e["action"], e["to"])
        for e in read_events(run)
        if e["event"] == "replicas_diverged"
    }
    assert got == {(40, "rewind", 0)}, got


# --- the slow tier: every script, policy and way of leaving ---------------------------
@pytest.mark.slow
def test_the_resnet_through_every_fault_kind_ends_bitwise_equal_to_its_fault_free_run(tmp_path):
    """BatchNorm averaged with the gradients, augmentation seeded per sample in 2 loader
    workers: before, the buffers differed across ranks without a fault, and the first
    SIGKILL ended the job at the batch check."""
    args = ("--steps", "14")
    clean = same_everywhere(zoo_run(tmp_path, "clean", "vision.py", args=args), 14)
    run = zoo_run(tmp_path, "faults", "vision.py", args=args, plan=EVERY_KIND)
    assert same_everywhere(run, 14) == clean
    faults_happened(run)


def preempt(tmp: Path, run: Path, cmd: list[str], at: int) -> None:
    """Start ``cmd``; SIGTERM its agent once a member committed step ``at``: every rank
    drains at a commit and the job ends with 143."""
    with open(tmp / f"{run.name}-preempted.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not (run / "events.jsonl").exists() or not any(
                e["event"] == "commit" and e["step"] >= at for e in read_events(run)
            ):
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == 143
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["lm.py", "text.py", "stream.py", "gan.py"])
def test_a_preempted_job_resumes_with_its_scheduler_exact(tmp_path, script):
    """SIGTERM to the agent with checkpoints on: every rank drains at a commit, the
    checkpoint holds the state after the script's post-commit code, and the same command
    resumes it to the fault-free result (the scheduler once came back a step behind; the
    loaders, the stream's position, the model's own counter, the GAN's second optimizer
    and schedulers come back with it)."""
    args = ("--steps", "16")
    clean = same_everywhere(zoo_run(tmp_path, "clean", script, args=args), 16)
    ck = tmp_path / "ck"
    flags = ("--checkpoint-dir", str(ck), "--checkpoint-every", "1000")
    run = tmp_path / "preempted"
    # (every rank's steps from step 6 on compute 100x as long, a pace and nothing else: the
    # GAN's 16 steps took 0.1 s in all, and its last ones were done before the SIGTERM came
    # in CI, which then ended the finished job with 0)
    pace = [{"kind": "slow", "rank": r, "at_step": 6, "arg": 100} for r in range(3)]
    cmd = command(run, script, *flags, plan=pace)
    preempt(tmp_path, run, cmd + [str(ZOO / script), *args, "--out", str(run / "out")], 6)
    resumed = zoo_run(tmp_path, "preempted", script, *flags, args=args)
    assert any(e["event"] == "restore" for e in read_events(resumed))
    assert same_everywhere(resumed, 16) == clean


@pytest.mark.slow
def test_a_stream_resumed_from_the_scripts_own_checkpoint_is_exact(tmp_path):
    """tests/zoo/stream.py keeps a checkpoint of its own (``torch.save`` every 4 steps,
    model, optimizer, the stream's position) and resumes from it, telling fastft the step
    (``ft.register(step=...)``); no ``--checkpoint-dir``. Through every fault kind, then
    a SIGTERM after step 9, the same command goes on from its last save and ends bitwise equal to
    the fault-free run (before, fastft began again at step 0 from the loaded weights)."""
    args = ("--steps", "16", "--workers", "2")
    clean = same_everywhere(zoo_run(tmp_path, "clean", "stream.py", args=args), 16)
    own = ("--save", str(tmp_path / "own.pt"))
    run = tmp_path / "own"
    pace = {"kind": "slow", "rank": 0, "at_step": 9, "arg": 100}  # (the SIGTERM before the end)
    cmd = command(run, "stream.py", plan=[*EVERY_KIND[:2], pace])
    cmd += [str(ZOO / "stream.py"), *args, *own]
    preempt(tmp_path, run, [*cmd, "--out", str(run / "out")], 9)
    faults_happened(run)
    resumed = zoo_run(tmp_path, "own2", "stream.py", args=(*args, *own))
    starts = [e for e in read_events(resumed) if e["event"] == "epoch"]
    assert starts and starts[0]["step"] in (8, 12), starts[:3]  # (its last save)
    assert same_everywhere(resumed, 16) == clean


SYNC_PLANS = {
    # every-k: a SIGKILL right after a sync step (the groups hold the same state then, so
    # the heal gives the restarted group its own; inside a window it takes a live group's
    # local steps: docs/hsdp.md). DiLoCo: exceptions, at a window's start and inside one.
    "every-k:4": [
        {"kind": "exception", "rank": 2, "at_step": 5, "life": 0},
        {"kind": "sigkill", "rank": 1, "at_step": 8, "life": 0},
    ],
    "diloco:4": [
        {"kind": "exception", "rank": 2, "at_step": 4, "life": 0},
        {"kind": "exception", "rank": 0, "at_step": 9, "life": 0, "point": "collective"},
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "script"),
    [("every-k:4", "vision.py"), ("every-k:4", "lm.py"), ("diloco:4", "lm.py")],
)
def test_a_script_under_a_sync_policy_through_faults_equals_its_fault_free_run(
    tmp_path, sync, script
):
    """Each rank against the same rank of the fault-free run (DiLoCo's groups hold their
    own parameters between outer steps); ranks equal at the end under every-k (16 steps:
    the last is a sync step). The replica check compares what every group advances alike
    (the parameters after a sync, the scheduler, the data position), not the EMA of a
    group's own parameters."""
    args = ("--steps", "16")
    # the GPT's EMA follows its group's own parameters, so differs between groups, and a
    # healed group takes its donor's: its plan has the exceptions alone
    plan = SYNC_PLANS[sync] if script == "vision.py" else SYNC_PLANS["diloco:4"]
    clean = finals(zoo_run(tmp_path, "clean", script, "--sync", sync, args=args))
    run = zoo_run(tmp_path, "faults", script, "--sync", sync, args=args, plan=plan)
    got = finals(run)
    for rank in (0, 1, 2):
        assert got[rank]["hash"] == clean[rank]["hash"], (rank, got, clean, unplanned(run))
        assert got[rank]["last_epoch"] == 16
    if sync.startswith("every-k") and script == "vision.py":
        same_everywhere(run, 16)
    assert any(e["event"] == "rollback" for e in read_events(run))


@pytest.mark.slow
@pytest.mark.parametrize("script", ["lm.py", "vision.py"])
def test_a_script_in_an_elastic_world_keeps_its_replicas_equal(tmp_path, script):
    """The world shrinks at a SIGKILL and grows back as the rank restarts and heals: the
    ranks end equal (the result is the fault-free one up to summation order)."""
    plan = [
        {"kind": "sigkill", "rank": 1, "at_step": 4, "life": 0},
        {"kind": "sigkill", "rank": 2, "at_step": 9, "life": 0, "point": "commit"},
    ]
    flags = ("--min-replicas", "2")
    run = zoo_run(tmp_path, "elastic", script, *flags, args=("--steps", "14"), plan=plan)
    got = finals(run)  # (a restarted rank that rejoins after the last step writes none)
    assert len(got) >= 2 and len({json.dumps(r["hash"]) for r in got.values()}) == 1, got
    assert {(r["step"], r["last_epoch"]) for r in got.values()} == {(14, 14)}
    faults_happened(run)


def test_a_loader_without_a_generator_and_a_models_own_counter_end_bitwise_equal(tmp_path):
    """tests/zoo/text.py (issue 61, cases 1 and 3): a ``StatefulDataLoader`` shuffling
    without a generator of its own (its iterators seeded from torch's global RNG: a
    restarted rank made one inside the step it rejoined at, and that step's dropout drew
    other masks) and a Python attribute of the model the script advances (rolled back,
    healed and checkpointed by nobody: ranks ended at 41/28/41 of 40)."""
    args = ("--steps", "14")
    clean = same_everywhere(zoo_run(tmp_path, "clean", "text.py", args=args), 14)
    run = zoo_run(tmp_path, "faults", "text.py", args=args, plan=EVERY_KIND)
    assert same_everywhere(run, 14) == clean
    assert clean["steps_seen"] == 14
    faults_happened(run)


def test_a_divergence_after_the_last_check_is_found_at_the_jobs_end(tmp_path):
    """Rank 2 nudges its EMA after the last step's commit (issue 61: no check compared the
    state after the last commit, and the job ended 0 with different replicas): the check
    at the job's end names the item and the member, and the job fails with exit 94's
    reason instead."""
    args = ("--steps", "6", "--perturb", "2:5")
    run = zoo_run(tmp_path, "late", "lm.py", args=args, expect=1)
    log = (run / "launcher.log").read_text()
    assert "at the job's end, after the commit of step 5" in log, log[-3000:]
    got = [e for e in read_events(run) if e["event"] == "replicas_diverged"]
    assert got and {(e["items"][0], tuple(e["minority"])) for e in got} == {("ema", (2,))}
    checks = [e for e in read_events(run) if e["event"] == "end_check"]
    assert checks and all(e["compared"] for e in checks), (
        checks
    )  # (the others: killed as it failed)


def test_a_gan_with_two_optimizers_and_two_schedulers_ends_bitwise_equal(tmp_path):
    """tests/zoo/gan.py (issue 61, case 6): two nets as one module, two optimizers as a
    list (``fastft.Optimizers``), a scheduler each, BatchNorm in one, through every fault
    kind; and a scheduler of the second optimizer left out is refused at register."""
    args = ("--steps", "14")
    clean = same_everywhere(zoo_run(tmp_path, "clean", "gan.py", args=args), 14)
    run = zoo_run(tmp_path, "faults", "gan.py", args=args, plan=EVERY_KIND)
    assert same_everywhere(run, 14) == clean
    assert clean["lr"][1] == pytest.approx(1e-3 * 0.95**14)
    faults_happened(run)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_of_shards_ends_bitwise_equal_through_every_fault_kind(tmp_path, workers):
    """tests/zoo/stream.py (issue 61, case 2): an ``IterableDataset`` read shard by shard,
    with random augmentation, under ``StatefulDataLoader`` with 0 or 2 workers, across a
    pass's end. fastft keeps the stream's position itself (the batches drawn in the pass,
    drawn again and dropped at a restore): torchdata's, restored, counted batches twice,
    and the first restart ended the job (exit 94, "'data' differs")."""
    args = ("--steps", "16", "--workers", str(workers))
    clean = same_everywhere(zoo_run(tmp_path, "clean", "stream.py", args=args), 16)
    run = zoo_run(tmp_path, "faults", "stream.py", args=args, plan=EVERY_KIND)
    assert same_everywhere(run, 16) == clean
    assert clean["pass"] == 1  # (a pass is 12 batches: the stream started again)
    faults_happened(run)
