"""The environment contract: every FASTFT_* variable in one table, the worker's environment
round trip, and `fastft run` flags that fall back to their variables (pure)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastft.errors import ConfigError
from fastft.launch.settings.config import LaunchConfig
from fastft.launch.settings.flags import add_run_flags, config_from_args, flag_variables
from fastft.process.env import VARIABLES, WORKER_VARS, WorkerEnv


@given(
    rank=st.integers(0, 1000),
    world=st.integers(1, 1000),
    life=st.none() | st.integers(0, 9),
    keep=st.none() | st.booleans(),
    inc=st.none() | st.integers(1, 2**62),
    run_dir=st.none() | st.text("abc/_-", min_size=1),
)
def test_the_worker_environment_round_trips(rank, world, life, keep, inc, run_dir):
    we = WorkerEnv(
        store="h:1",
        job="j",
        rank=rank,
        world_size=world,
        life=life,
        keep_gradients=keep,
        incarnation=inc,
        run_dir=run_dir,
    )
    env = we.to_env()
    assert set(env) <= set(VARIABLES)
    assert WorkerEnv.from_env(env) == we


def test_a_missing_or_malformed_variable_names_itself():
    with pytest.raises(ConfigError, match="FASTFT_STORE is not set"):
        WorkerEnv.from_env({})
    base = WorkerEnv(store="h:1", job="j", rank=0, world_size=1).to_env()
    with pytest.raises(ConfigError, match="FASTFT_SEED='x': expected an integer"):
        WorkerEnv.from_env({**base, WORKER_VARS["seed"]: "x"})


def test_every_variable_is_documented_once():
    assert all(name.startswith("FASTFT_") and doc for name, doc in VARIABLES.items())
    flags = flag_variables()
    assert flags["FASTFT_HANG_TIMEOUT"] == "--hang-timeout"
    assert flags["FASTFT_NPROC"] == "--nproc"
    # a flag and a worker variable of the same name mean the same thing
    for shared in set(flags) & set(VARIABLES):
        assert shared in {
            "FASTFT_STORE",
            "FASTFT_JOB",
            "FASTFT_SEED",
            "FASTFT_MIN_REPLICAS",
            "FASTFT_RUN_DIR",
            "FASTFT_INJECT",
            "FASTFT_CHECK_EVERY",
            "FASTFT_COMPARE_EVERY",
            "FASTFT_BUFFERS",
            "FASTFT_DECIDE",
            "FASTFT_KEEP_GRADIENTS",
            "FASTFT_BACKEND",
            "FASTFT_HANG_PACE",
            "FASTFT_SPARE_PREFAULT_MB",
            "FASTFT_CHECKPOINT_DIR",
            "FASTFT_CHECKPOINT_EVERY",
            "FASTFT_CHECKPOINT_INTERVAL",
            "FASTFT_HANG_TIMEOUT",
            "FASTFT_BETWEEN_STEPS_TIMEOUT",
            "FASTFT_HEALTH_HOST_MB",
            "FASTFT_CHECKPOINT_KEEP",
            "FASTFT_ALLOW_FRESH_START",
            "FASTFT_SHARD_SIZE",
            "FASTFT_SYNC",
            "FASTFT_STAGE",
            "FASTFT_DRAIN_GRACE",
            "FASTFT_MAX_RECOVERIES",
            "FASTFT_FLOW",
            "FASTFT_FLOW_NAME",
            "FASTFT_MAX_AHEAD",
        }, shared


def _parse(argv, env):
    p = argparse.ArgumentParser()
    add_run_flags(p, env)
    return config_from_args(p.parse_args(argv), ("python", "x.py"))


def test_flags_fall_back_to_their_variables_then_to_the_default():
    assert _parse([], {}) == LaunchConfig(command=("python", "x.py"))
    cfg = _parse([], {"FASTFT_NPROC": "3", "FASTFT_HANG_PACE": "0", "FASTFT_EXIT_TRACE": "0"})
    assert (cfg.nproc, cfg.hang_pace, cfg.exit_trace) == (3, False, False)
    assert _parse(["--adaptive-hang"], {"FASTFT_HANG_PACE": "0"}).hang_pace  # (the old flag)
    cfg = _parse(["--nproc", "2", "--hang-timeout", "7"], {"FASTFT_NPROC": "3"})
    assert (cfg.nproc, cfg.hang_timeout_s) == (2, 7.0)
    assert _parse(["--no-keep-gradients"], {}).keep_gradients is False


@pytest.mark.parametrize(
    "flags, relayed",
    [
        ([], False),  # 1 worker
        (["--nproc", "8"], False),  # 8 workers: the store's work is small, the hop is not
        (["--nproc", "8", "--nnodes", "8", "--store", "h:1"], True),  # 64 workers
        (["--nproc", "1", "--nnodes", "64", "--store", "h:1"], False),  # nothing to relay to
        (["--nproc", "2", "--bus-relay", "on"], True),
        (["--nproc", "8", "--nnodes", "8", "--store", "h:1", "--bus-relay", "off"], False),
    ],
)
def test_bus_relay_auto_relays_from_64_workers_with_2_or_more_a_node(flags, relayed, tmp_path):
    from fastft.protocol.auth import JobSecret

    if "--nnodes" in flags:  # (several nodes need the job secret's file)
        JobSecret.draw().save(tmp_path / "s")
        flags = [*flags, "--job-secret-file", str(tmp_path / "s")]
    assert _parse(flags, {}).relayed is relayed


def test_a_malformed_flag_variable_fails_at_start():
    with pytest.raises(ConfigError, match="FASTFT_NPROC='many'"):
        _parse([], {"FASTFT_NPROC": "many"})


def test_every_launch_field_but_the_command_and_env_is_a_flag():
    names = {f.name for f in dataclasses.fields(LaunchConfig)} - {"command", "env"}
    assert len(flag_variables()) == len(names)


def test_the_agent_sets_omp_threads_as_torchrun_does_and_counts_threads():
    from fastft.launch.settings.workerenv import cpu_warnings

    cfg = LaunchConfig(command=("x.py",), nproc=2)
    environ: dict[str, str] = {}
    lines = cpu_warnings(cfg, environ, cores=2)
    assert environ["OMP_NUM_THREADS"] == "1" and "OMP_NUM_THREADS=1" in lines[0]
    assert len(lines) == 1  # 2 workers x 1 thread on 2 cores: no competition
    environ = {}
    assert cpu_warnings(LaunchConfig(command=("x.py",), nproc=2), environ, cores=16)
    assert environ["OMP_NUM_THREADS"] == "8"
    environ = {"OMP_NUM_THREADS": "4"}  # the user's own: kept, and its threads counted
    lines = cpu_warnings(cfg, environ, cores=2)
    assert environ["OMP_NUM_THREADS"] == "4"
    assert len(lines) == 1 and "2 workers x 4 threads" in lines[0]
    environ = {}  # 7 workers on 2 cores, one thread each (the demo's 4 and 3 spares): no warning
    many = LaunchConfig(command=(sys.executable, "train.py"), nproc=7, warm_spares=3)
    assert [x for x in cpu_warnings(many, environ, cores=2) if "WARNING" in x] == []
    environ = {}  # one worker: torch's own default
    assert cpu_warnings(LaunchConfig(command=("x.py",), nproc=1), environ, cores=2) == []
    assert "OMP_NUM_THREADS" not in environ


def test_every_run_flag_is_in_one_help_section():
    from fastft.launch.settings.flags import GROUPS

    names = [n for names in GROUPS.values() for n in names]
    flags = {f.name for f in dataclasses.fields(LaunchConfig) if f.metadata.get("help")}
    assert len(names) == len(set(names)), "a flag in two sections"
    assert set(names) == flags, (sorted(flags - set(names)), sorted(set(names) - flags))


def _life_env(cfg: LaunchConfig, **life: object) -> dict[str, str]:
    """One worker life's environment, with placeholder paths."""
    from fastft.launch.settings.workerenv import worker_environment

    base = dict(rank=0, life=0, incarnation=9, local_rank=0, store_addr="h:1", run_dir="/r")
    paths = dict(heartbeat_file="/r/hb", exit_trace_file=None, secret_file="/s")
    return worker_environment(cfg, **{**base, **paths, **life})  # type: ignore[arg-type]


def test_the_worker_environment_is_derived_from_the_shared_fields(monkeypatch):
    """Every flag the worker shares with its agent reaches it (derived from the field
    lists, not copied one by one), and a variable left in the agent's own environment
    cannot override a flag."""
    from fastft.process.env import WorkerEnv

    monkeypatch.setenv("FASTFT_SEED", "5")  # (the user's shell, say)
    cfg = LaunchConfig(command=("x.py",), nproc=2, seed=0, hang_timeout_s=7.0)
    env = _life_env(cfg, rank=1, local_rank=1)
    var = {f.name: f.metadata["var"] for f in dataclasses.fields(WorkerEnv)}
    flags = {f.name for f in dataclasses.fields(LaunchConfig)}
    for name in set(var) & flags - {"flow_name", "max_ahead", "min_replicas", "inject"}:
        if getattr(cfg, name) is not None:
            assert var[name] in env, f"{name} does not reach the worker"
    assert env["FASTFT_SEED"] == "0" and env["FASTFT_HANG_TIMEOUT"] == "7.0"
    assert env["FASTFT_STORE"] == "h:1" and env["FASTFT_RUN_DIR"] == "/r"


def test_the_flags_given_are_the_flags_each_ray_node_gets():
    # fastft ray run hands every node's agent the flags the user gave (not their defaults,
    # which each agent reads itself), less the node flags it sets per node
    from fastft.launch.settings.flags import run_argv

    p = argparse.ArgumentParser()
    add_run_flags(p, env={})
    given = ["--nproc", "2", "--min-replicas", "1", "--no-exit-trace", "--no-hang-pace"]
    args = p.parse_args([*given, "--run-dir", "/x", "--hang-timeout", "7.5"])
    argv = run_argv(args, skip=frozenset({"run_dir"}))
    assert "--run-dir" not in argv and argv[argv.index("--nproc") + 1] == "2"
    assert sorted(argv) == sorted([*given, "--hang-timeout", "7.5"])
    again = p.parse_args(argv)
    assert config_from_args(again, ("x",)) == dataclasses.replace(
        config_from_args(args, ("x",)), run_dir=None
    )


def test_ray_run_keeps_the_standby_agents_itself(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "t.py"
    script.write_text("")
    cmd = [sys.executable, "-m", "fastft.cli", "ray", "run", "--nodes", "2", "--standby"]
    p = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "sets --standby itself" in p.stderr, p.stderr


def test_the_job_clock_is_the_first_agents_and_reaches_every_worker(store):
    """``ft.elapsed_s`` counts from the job's start: the first agent's, the same for a later
    agent (another node, a restarted one) and in every worker life's environment."""
    import time

    from fastft.launch.control import job_start
    from fastft.protocol import JobKeys
    from fastft.runtime.contract import RuntimeConfig

    keys = JobKeys("clock")
    first = job_start(store, keys)
    time.sleep(0.01)
    assert job_start(store, keys) == first and abs(first - time.time()) < 5
    cfg = LaunchConfig(command=("x.py",), nproc=1)
    env = _life_env(cfg, life=2, job_started=first)
    assert RuntimeConfig.from_env(env).job_started == first
