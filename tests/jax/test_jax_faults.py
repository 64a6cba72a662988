"""The fault catalogue against the JAX demo (``fastft.demo.train_jax``) under ``fastft
run``, 3 workers on CPU with Gloo: each run ends bitwise equal to the fault-free JAX run
(fixed world), or consumes every sample once (elastic). S1 and S3 are checked on every
run's events, as in the torch fault tier."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from _jaxruns import JAX_DEMO
from _runs import STEPS, check_s1_s3, fastft_run, finals

from fastft.protocol.exits import EXIT_SCRIPT_ERROR
from fastft.report import shards_by_step, untiled_steps
from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(240)

ALL_AT_17 = [{"kind": "sigkill", "rank": r, "at_step": 17, "point": "commit"} for r in range(3)]


def _equal(run, clean_jax) -> None:
    check_s1_s3(run)
    assert {v["digest"] for v in finals(run).values()} == {finals(clean_jax)[0]["digest"]}


def test_exception_sigkill_sigstop_and_a_state_loss(tmp_path, clean_jax):
    plan = [
        {"kind": "exception", "rank": 1, "at_step": 6},
        {"kind": "sigkill", "rank": 2, "at_step": 12},
        {"kind": "sigstop", "rank": 0, "at_step": 20},
        {"kind": "state_lost", "rank": 1, "at_step": 25},
    ]
    run = fastft_run(tmp_path, "faulty", plan=plan, script=JAX_DEMO)
    _equal(run, clean_jax)
    ev = read_events(run)
    assert sum(e["event"] == "restart" for e in ev) == 2  # the killed and the stopped one
    fetched = [(e["src"], e["step"]) for e in ev if e["event"] == "heal" and e["role"] == "fetch"]
    # the restarted ranks healed their pytrees from a survivor; rank 1 its lost state
    assert {("rank 2", 12), ("rank 0", 20), ("rank 1", 25)} <= set(fetched)
    # the zygote preloaded JAX for the script (unasked): a restart is a fork of it
    (z,) = [e for e in ev if e["event"] == "zygote_start"]
    assert z["preload"] == ["?jax", "?fastft.jax"]
    assert all(e["how"] == "fork" for e in ev if e["event"] == "spawn")


def test_a_gil_hang_and_a_drain(tmp_path, clean_jax):
    plan = [
        {"kind": "gil_hang", "rank": 2, "at_step": 8, "arg": 600},
        {"kind": "sigterm", "rank": 1, "at_step": 18},  # a preemption notice: a drain
    ]
    run = fastft_run(tmp_path, "gil", "--hang-timeout", "30", plan=plan, script=JAX_DEMO)
    _equal(run, clean_jax)
    ev = read_events(run)
    assert [e["rank"] for e in ev if e["event"] == "worker_hung"] == [2]
    assert [e["src"] for e in ev if e["event"] == "drained"] == ["rank 1"]


def test_a_total_loss_restores_the_checkpoint(tmp_path, clean_jax):
    ckpt = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--decide", "store")
    run = fastft_run(
        tmp_path, "total", *flags, plan=ALL_AT_17, train=("--step-time", "0.1"), script=JAX_DEMO
    )
    _equal(run, clean_jax)
    restores = [e for e in read_events(run) if e["event"] == "restore"]
    assert len(restores) == 3 and 5 <= restores[0]["step"] <= 17


def test_a_total_loss_without_a_checkpoint_fails_and_says_why(tmp_path):
    run = fastft_run(
        tmp_path,
        "lost",
        "--decide",
        "store",
        plan=ALL_AT_17,
        steps=20,
        expect_rc=1,
        script=JAX_DEMO,
    )
    log = (run / "launcher.log").read_text()
    assert "every holder of the committed state" in log and "--checkpoint-dir" in log


def test_an_elastic_world_consumes_every_sample_once(tmp_path, clean_jax):
    plan = [
        {"kind": "sigkill", "rank": 2, "at_step": 8},
        {"kind": "exception", "rank": 0, "at_step": 16},
    ]
    run = fastft_run(
        tmp_path,
        "elastic",
        "--min-replicas",
        "2",
        plan=plan,
        train=("--step-time", "0.03"),
        script=JAX_DEMO,
    )
    ev = read_events(run)
    shards = shards_by_step(ev)
    assert sorted(shards) == list(range(STEPS)) and not untiled_steps(shards)
    # a step of 2 members sums its gradient in another order than one of 3: equal up to that
    ref = np.load(clean_jax / "out" / "final-rank0.npy")
    for f in (run / "out").glob("final-rank*.npy"):
        assert np.abs(np.load(f) - ref).max() <= 1e-4, f


def test_a_donated_committed_buffer_stops_the_job_with_the_reason(tmp_path):
    script = tmp_path / "donate.py"
    script.write_text(
        "import jax, jax.numpy as jnp, fastft.jax\n"
        "ft = fastft.jax.init()\n"
        "ft.register(params={'w': jnp.ones(4)})\n"
        "step = jax.jit(lambda p: {'w': p['w'] * 2}, donate_argnums=0)\n"
        "while ft.step < 5:\n"
        "    with ft.transaction() as tx:\n"
        "        tx.propose(params=step(ft.state['params']))\n"
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastft.cli",
            "run",
            "--nproc",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "donate" in p.stderr and "committed" in p.stderr, p.stderr[-2000:]
    ev = read_events(tmp_path / "run")
    assert any(e["event"] == "script_error" for e in ev)
    codes = {e["exit_code"] for e in ev if e["event"] == "worker_exit"}
    assert EXIT_SCRIPT_ERROR in codes, json.dumps(codes, default=str)


def test_a_sync_policy_of_the_torch_runtime_fails_a_jax_job_at_start(tmp_path):
    run = fastft_run(
        tmp_path, "sync", "--sync", "every-k:2", script=JAX_DEMO, expect_rc=None, steps=5
    )
    assert int((run / "rc").read_text()) != 0
    log = (run / "launcher.log").read_text()
    assert "a JAX job syncs its gradient at every step" in log, log[-2000:]
