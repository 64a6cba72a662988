"""JAX's own fault behaviour, kept as canaries (issue 52): what ``fastft.jax`` is built
around (docs/jax.md, *Why not jax.distributed*), checked against the installed JAX with a
small ``jax.distributed`` job of 3 processes on CPU (``_jax_canary.py``: the documented
``jax_enable_recoverability`` + ``live_devices`` loop, a 2 s heartbeat).

A plain test is what JAX does today; an ``xfail(strict=True)`` is what it does not do yet.
A JAX release that changes either flips a test, and the docs' claims (and maybe fastft's
design: a replicate group as a ``jax.distributed`` world of its own) must be read again.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("_jax_canary.py")
NPROC = 3


class Job:
    """A ``jax.distributed`` job of ``_jax_canary.py`` processes; ended by PID."""

    def __init__(self, d: Path, **extra: dict[int, list[str]]) -> None:
        self.d = d
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        self.procs: dict[tuple[int, int], subprocess.Popen] = {}
        self.extra = extra.get("args", {})
        for i in range(NPROC):
            self.start(i)

    def start(self, i: int, life: int = 0) -> None:
        cmd = [sys.executable, str(WORKER), "--coordinator", self.coordinator, "--nproc"]
        cmd += [str(NPROC), "--pid", str(i), "--out", str(self.d / f"p{i}.{life}.jsonl")]
        cmd += self.extra.get(i, []) if life == 0 else []
        log = open(self.d / f"p{i}.{life}.log", "w")  # noqa: SIM115 (the child keeps its fd)
        self.procs[(i, life)] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def records(self, i: int, life: int = 0) -> list[dict]:
        try:
            text = (self.d / f"p{i}.{life}.jsonl").read_text()
        except OSError:
            return []
        return [json.loads(x) for x in text.splitlines() if x.strip()]

    def wait_for(self, what, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if what():
                return True
            time.sleep(0.1)
        return False

    def log(self, i: int, life: int = 0) -> str:
        return (self.d / f"p{i}.{life}.log").read_text()[-1500:]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture
def job_of(tmp_path):
    jobs: list[Job] = []

    def make(**args: list[str]) -> Job:
        job = Job(tmp_path, args={int(k[1:]): v for k, v in args.items()})
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


def _steps_of(job: Job, i: int, n: int) -> list[dict]:
    return [r for r in job.records(i) if "step" in r and r.get("n") == n and "failed" not in r]


def test_survivors_of_a_death_between_collectives_go_on_with_fewer_devices(job_of):
    job = job_of(p2=["--die", "3"])
    went_on = job.wait_for(lambda: all(len(_steps_of(job, i, 2)) >= 3 for i in (0, 1)), 60)
    assert went_on, (job.records(0)[-5:], job.log(0))


@pytest.mark.xfail(
    strict=True,
    reason="jax 0.10.2: a restarted process cannot register "
    "under its id again (ALREADY_EXISTS), and its attempts stall the survivors",
)
def test_a_restarted_process_rejoins_the_survivors(job_of):
    job = job_of(p2=["--die", "3"])
    assert job.wait_for(lambda: len(_steps_of(job, 0, 2)) >= 1, 60)
    job.procs[(2, 0)].wait(timeout=30)
    job.start(2, life=1)
    back = job.wait_for(
        lambda: any("step" in r and "failed" not in r for r in job.records(2, 1)), 20
    )
    assert back and _steps_of(job, 0, 3)[-1]["t"] > job.records(2, 1)[0]["t"]


@pytest.mark.xfail(
    strict=True,
    reason="jax 0.10.2: XLA's CPU collectives cannot be "
    "interrupted; a peer stopped before a collective holds the others in it "
    "until --xla_cpu_collective_timeout_seconds (30 min by default)",
)
def test_a_collective_whose_peer_stopped_ends_within_seconds(job_of):
    job = job_of(p2=["--stop", "3"])
    assert job.wait_for(lambda: len(_steps_of(job, 0, 3)) >= 3, 60)
    t_stop = time.time()
    # the survivors are in step 3's collective: a failure, or a step with 2 devices
    ended = job.wait_for(
        lambda: any(r["t"] > t_stop and ("failed" in r or r.get("n") == 2) for r in job.records(0)),
        10,
    )
    assert ended


@pytest.mark.xfail(
    strict=True,
    reason="jax 0.10.2: process 0 hosts the coordination "
    "service; when it dies the others cannot go on",
)
def test_survivors_of_process_0s_death_go_on(job_of):
    job = job_of(p0=["--die", "3"])
    survivors = [job.procs[(i, 0)] for i in (1, 2)]
    job.wait_for(
        lambda: (
            all(len(_steps_of(job, i, 2)) >= 3 for i in (1, 2))
            or any(p.poll() is not None for p in survivors)
        ),  # (one ended: it cannot go on)
        40,
    )
    assert all(len(_steps_of(job, i, 2)) >= 3 for i in (1, 2))


def test_jax_distributed_starts_again_in_a_process(job_of):
    """Shut down and initialized again in the same process (what an in-process
    re-formation would need): it works once process 0 has restarted the coordination
    service (the others wait 2 s: registering earlier can reach the old service, whose
    end is then fatal), at ~1 s and the old world's arrays and compiled functions."""
    plain = ["--reinit", "--plain"]  # (with recoverability the shutdown does not synchronize)
    job = job_of(p0=plain, p1=plain, p2=plain)
    done = job.wait_for(lambda: all(len(_steps_of(job, i, 3)) >= 2 for i in range(NPROC)), 60)
    assert done, job.log(0)
    (again,) = [r for r in job.records(0) if "reinit_ms" in r]
    assert again["n"] == NPROC
