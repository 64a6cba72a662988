"""``fastft ray run``'s decisions without Ray (:mod:`fastft.ray.plan`): the agents'
command lines, the placement group's bundles and strategy, and what an agent actor's poll
or silence means for the job."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fastft.errors import RayJobError
from fastft.ray import plan

HAVE = {"CPU": 8.0, "GPU": 0.0}


def test_nproc_is_added_or_must_agree():
    assert plan.with_nproc(["train.py", "--nproc", "9"], 2) == [
        "--nproc",
        "2",
        "train.py",
        "--nproc",
        "9",
    ]
    assert plan.with_nproc(["--nproc=2", "-m", "m"], 2) == ["--nproc=2", "-m", "m"]
    with pytest.raises(RayJobError, match="--nproc 3 in argv, but nproc=2"):
        plan.with_nproc(["--nproc", "3", "t.py"], 2)


def _bundles(**given):
    """plan.plan_bundles with 2 nodes of 2 workers on 2 machines of HAVE, unless given."""
    args = dict(nodes=2, nproc=2, cpus_per_node=None, gpus_per_node=0.0, placement="strict")
    return plan.plan_bundles(**{**args, "have": HAVE, "machines": 2, **given})


def test_bundles_are_one_per_machine_unless_spread_is_asked():
    b = _bundles()
    assert (b.bundle, b.count, b.strategy) == ({"CPU": 3.0}, 2, "STRICT_SPREAD")
    with pytest.raises(RayJobError, match="1 machine.*--placement spread"):
        _bundles(machines=1)
    b = _bundles(placement="spread", machines=1)
    assert b.strategy == "SPREAD" and "no node has a bundle's worth free" in b.unplaced(60)


def test_a_cluster_short_of_resources_fails_saying_what_to_change():
    with pytest.raises(RayJobError, match="the cluster has 8 CPU; 3 nodes of 4 CPU.*need 12 CPU"):
        _bundles(nodes=3, cpus_per_node=4, placement="spread", machines=3)
    with pytest.raises(RayJobError, match="0 GPU"):
        _bundles(nodes=1, nproc=1, gpus_per_node=1, machines=1)
    b = _bundles(nodes=1, nproc=1, gpus_per_node=1, have={"CPU": 4, "GPU": 1}, machines=1)
    assert b.bundle == {"CPU": 2.0, "GPU": 1} and "a machine of its own" in b.unplaced(60)
    with pytest.raises(RayJobError, match="--placement 'pack'"):
        _bundles(nodes=1, nproc=1, placement="pack", machines=1)


def test_each_node_agent_gets_its_rank_plane_secret_and_the_users_flags():
    got = plan.node_argv(
        1,
        nodes=2,
        plane=["--control", "nats://a"],
        secret_path="/r/s",
        run_dir="/r",
        job="j",
        argv=["--nproc", "2", "t.py"],
    )
    assert got == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--control",
        "nats://a",
        "--job-secret-file",
        "/r/s",
        "--run-dir",
        "/r",
        "--job",
        "j",
        "--nproc",
        "2",
        "t.py",
    ]


def test_an_agent_actors_new_life_is_read_from_its_start_and_said():
    t = plan.AgentTrack(0)
    assert not t.polled({"pid": 10, "lines": ["a", "b"], "rc": None})
    assert t.printed({"pid": 10, "lines": ["a", "b"], "rc": None}) == ["a", "b"]
    assert t.offset == 2 and t.status is None and t.notes == []
    assert t.polled({"pid": 11, "lines": [], "rc": None})  # (an actor Ray restarted)
    assert t.offset == 0 and "answers from a new process (pid 11)" in t.notes[0]
    t.printed({"pid": 11, "lines": ["x"], "rc": 0})
    assert t.status == 0


def test_an_agent_actor_silent_for_long_is_counted_as_failed():
    t = plan.AgentTrack(3)
    t.silent(100.0)
    t.silent(100.0 + plan.GONE_AFTER_S)
    assert t.status is None
    t.polled({"pid": 5, "lines": [], "rc": None})  # an answer: the silence starts again
    t.silent(1000.0)
    t.silent(1000.0 + plan.GONE_AFTER_S + 1)
    assert t.status == 1 and "node 3's agent actor has not answered" in t.notes[0]


def test_the_jobs_status_is_the_first_failure():
    assert plan.job_status([0, 0]) == 0
    assert plan.job_status([0, 86, 1]) == 86


def test_an_address_where_nothing_listens_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RayJobError, match=f"no Ray cluster at 127.0.0.1:{port}"):
        plan.reachable(f"127.0.0.1:{port}")
    with pytest.raises(RayJobError, match="use HOST:PORT"):
        plan.reachable("head:gcs")
    plan.reachable("auto")
    assert plan.loopback("127.0.0.1:6379") and not plan.loopback("10.0.0.2:6379")


def test_a_trainers_flags_carry_its_configs_and_preload_jax_for_a_jax_function(
    monkeypatch, tmp_path
):
    import sys

    from fastft.ray import FailureConfig, RunConfig, Trainer

    t = Trainer(
        lambda config: None,
        run_config=RunConfig(checkpoint_every=5, flags=["--min-replicas", "2"]),
        failure_config=FailureConfig(max_worker_restarts=4),
    )
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    assert t.fastft_flags(tmp_path) == [
        "--min-replicas", "2", "--checkpoint-dir", str(tmp_path / "checkpoints"),
        "--checkpoint-every", "5", "--max-restarts", "4",
    ]  # fmt: skip
    monkeypatch.setitem(sys.modules, "jax", object())  # (a driver that imported JAX)
    assert t.fastft_flags(tmp_path)[-2:] == ["--preload", "jax,fastft.jax"]
    script = Trainer("train.py", run_config=RunConfig(flags=["--preload=x"]))
    assert "jax,fastft.jax" not in script.fastft_flags(tmp_path)
    with pytest.raises(ValueError, match="only for a training function"):
        Trainer("train.py", train_loop_config={"lr": 1})


def test_a_dead_agent_actor_is_replaced_by_its_standby_until_out_of_restarts():
    t = plan.AgentTrack(1, max_restarts=2)
    t.polled({"pid": 10, "lines": [], "rc": None})
    t.printed({"pid": 10, "lines": ["a"], "rc": None})
    assert t.died(standby=True) == "standby"
    assert (t.life, t.offset, t.status) == (None, 0, None)  # (the standby's output from 0)
    assert "its standby agent takes the node over (restart 1 of 2)" in t.notes[-1]
    assert not t.polled({"pid": 20, "lines": [], "rc": None})  # (a new actor: no re-read)
    assert t.died(standby=False) == "new" and "a new agent starts (restart 2 of 2)" in t.notes[-1]
    assert t.died(standby=True) == "failed" and t.status == 1
    assert "after 2 restart(s) of the node (--max-node-restarts)" in t.notes[-1]


def test_a_failed_trainings_error_says_what_failed_it():
    """Issue 62: a training function's ValueError ended in "the job failed (status 1)"."""
    from fastft.ray.trainer import Result, TrainingFailed, _why_failed

    ev = [
        {"event": "local_fault", "src": "rank 1", "cause": "ValueError: bad shape (3, 4)"},
        {"event": "job_failed", "src": "agent 0", "reason": "rank 1 failed 4 times"},
    ]
    why = _why_failed(ev)
    assert why == "rank 1: ValueError: bad shape (3, 4); rank 1 failed 4 times"
    result = Result(metrics={}, path=Path("/tmp/run"), checkpoint=None, summary={})
    assert "bad shape (3, 4)" in str(TrainingFailed(1, result, why))
