"""The fault tier's runs (imported by its test modules; the clean run is a session fixture
in conftest.py): `fastft run` with 3 Gloo workers on CPU, training the demo, and
the checks every faulty run is held to (S1, S3 against the events; S5 against a clean run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from fastft.runtime import read_events

STEPS = 30


def fastft_run(
    tmp: Path,
    name: str,
    *flags: str,
    plan: list[dict] | None = None,
    steps: int = STEPS,
    timeout: float = 150,
    train: tuple[str, ...] = (),
    expect_rc: int | None = 0,
    nproc: int = 3,
    script: str = "fastft.demo.train",
) -> Path:
    run = tmp / name
    cmd = [
        sys.executable,
        "-m",
        "fastft.cli",
        "run",
        "--nproc",
        str(nproc),
        "--run-dir",
        str(run),
        "--check-every",
        "1",
        "--job",
        name,
        *flags,
    ]
    if plan is not None:
        run.mkdir(parents=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += ["-m", script, "--", "--steps", str(steps), "--out", str(run / "out")]
    cmd += train
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "launcher.log", "w") as log:  # kept: hung workers' stack dumps land here
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert expect_rc is None or p.returncode == expect_rc, (run / "launcher.log").read_text()[
        -3000:
    ]
    (run / "rc").write_text(str(p.returncode))
    return run


def finals(run: Path) -> dict[int, dict]:
    return {
        int(f.stem.split("rank")[1]): json.loads(f.read_text())
        for f in (run / "out").glob("final-rank*.json")
    }


REPLACED = ("restore", "rewind")
"""Events after which a member's state is another's: a checkpoint's, its verified copy's."""


def check_s1_s3(run: Path, steps: int = STEPS, *, shard_size: int = 1, sync_every: int = 1) -> None:
    """S1 per life, S3 per step (with shard groups: among the members of each shard index,
    who hold the same part of the model; with ``--sync every-k:N``: after the sync steps,
    the others being each group's own; after a rewind, the steps' commits run again)."""
    ev = read_events(run)
    by_step: dict[tuple[int, int], set[str]] = defaultdict(set)
    history: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    life: dict[str, int] = defaultdict(int)
    # A worker's history restarts where it took a peer's state: when it joins again (left
    # out while it healed itself in place, admitted at a later step), and when a survivor
    # behind its peers fetches their state (under the step's collective decision, one whose
    # decision a dying peer's notice cut short rolls the step back while the others commit
    # it: it heals to their step), and when the job restores a checkpoint after a total
    # loss (or starts again from step 0 where --allow-fresh-start allows). Its next commit is then the healed step's, never one
    # before (a step applied twice) or after (one skipped).
    segment: dict[str, int] = defaultdict(int)
    healed_to: dict[tuple[str, int, int], int] = {}
    # A rewind (a replica mismatch's repair) takes every member back to a verified step:
    # the commits after it replace those of the steps it runs again (a corrupted member's
    # differed; the repaired ones must agree)
    rewinds: set[int] = set()
    for e in ev:
        if e["event"] == "rewind":
            if e["epoch"] not in rewinds:
                for key in [k for k in by_step if k[0] >= e["step"]]:
                    del by_step[key]
            rewinds.add(e["epoch"])
        if e["event"] == "worker_start":
            life[e["src"]] = e["incarnation"]
        if e["event"] == "join_wait":
            segment[e["src"]] += 1
        if e["event"] == "heal" and e.get("role") == "fetch" or e["event"] in REPLACED:
            segment[e["src"]] += 1
            healed_to[(e["src"], life[e["src"]], segment[e["src"]])] = e["step"]
        if e["event"] == "fresh_start":
            segment[e["src"]] += 1
            healed_to[(e["src"], life[e["src"]], segment[e["src"]])] = 0
        if e["event"] == "commit":
            index = int(e["src"].split()[1]) % shard_size
            by_step[(e["step"], index)].add(e["digest"])
            history[(e["src"], life[e["src"]], segment[e["src"]])].append(e["step"])
    for who, step in healed_to.items():
        seq = history.get(who)
        assert not seq or seq[0] == step, f"S1: {who} healed to step {step}, then applied {seq}"
    assert sorted({s for s, _ in by_step}) == list(range(steps)), "a step was never committed"
    for (step, index), digests in by_step.items():
        if (step + 1) % sync_every:
            continue
        assert len(digests) == 1, f"S3: members disagree after step {step}: {digests} ({index=})"
    for who, seq in history.items():
        assert seq == list(range(seq[0], seq[0] + len(seq))), f"S1: {who} applied {seq}"
    for e in ev:  # nothing the job itself sent was dropped (a death notice once was)
        if e["event"] == "worker_stop":
            assert not e["rejected"]["replayed"], f"{e['src']} dropped valid frames: {e}"


STATEFUL_EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "stateful_data.py")


def stateful_run(
    tmp: Path,
    name: str,
    *flags: str,
    nproc: int,
    data: tuple[int, int, int],
    plan: list[dict] | None = None,
    script: tuple[str, ...] = (),
    timeout: float = 240,
) -> tuple[Path, int]:
    """`fastft run` of examples/stateful_data.py (``data``: steps, batch, samples), its
    samples logged per rank under ``samples/``; the run's folder and exit status."""
    steps, batch, samples = data
    run = tmp / name
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(nproc)]
    cmd += ["--run-dir", str(run), "--job", name, *flags]
    if plan:
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += [STATEFUL_EXAMPLE, "--steps", str(steps), "--batch", str(batch)]
    cmd += ["--samples", str(samples), "--out", str(run / "out")]
    cmd += ["--samples-out", str(run / "samples"), *script]
    with open(run / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    return run, p.returncode
