"""The worker's configuration from the launcher's environment (RuntimeConfig.from_env)."""

from __future__ import annotations

import platform

import pytest

from fastft.errors import ConfigError
from fastft.process.env import WORKER_VARS as ENV
from fastft.runtime.contract import RuntimeConfig, choose_backend

BASE = {
    ENV["store"]: "127.0.0.1:1234",
    ENV["job"]: "j",
    ENV["rank"]: "1",
    ENV["world_size"]: "3",
}


def test_reads_the_launchers_variables():
    cfg = RuntimeConfig.from_env({**BASE, ENV["min_replicas"]: "2", ENV["seed"]: "7"})
    assert (cfg.rank, cfg.world_size, cfg.min_members, cfg.seed) == (1, 3, 2, 7)
    assert cfg.elastic and cfg.keep_gradients
    assert not RuntimeConfig.from_env(BASE).elastic  # min_replicas defaults to the world


@pytest.mark.parametrize("raw, want", [("0", False), ("1", True), ("", True), ("no", False)])
def test_keep_gradients_switch(raw, want):
    assert RuntimeConfig.from_env({**BASE, ENV["keep_gradients"]: raw}).keep_gradients is want
    assert RuntimeConfig.from_env(BASE, keep_gradients=False).keep_gradients is False


@pytest.mark.parametrize(
    "env, match",
    [
        ({ENV["keep_gradients"]: "maybe"}, "FASTFT_KEEP_GRADIENTS='maybe': expected 0 or 1"),
        ({ENV["store"]: ""}, "FASTFT_STORE is not set"),
        ({ENV["rank"]: "x"}, "FASTFT_RANK=.x.: expected an integer"),
        ({ENV["min_replicas"]: "9"}, "min_replicas=9"),
        ({ENV["backend"]: "mpi"}, "backend='mpi': use auto, gloo or nccl"),
    ],
)
def test_bad_variables_say_what_to_fix(env, match):
    with pytest.raises(ConfigError, match=match):
        RuntimeConfig.from_env({**BASE, **env})


def test_backend_from_the_environment():
    assert RuntimeConfig.from_env(BASE).backend == "auto"
    assert RuntimeConfig.from_env({**BASE, ENV["backend"]: "gloo"}).backend == "gloo"


@pytest.mark.parametrize(
    "backend, devices, local_world, gpus, want",
    [
        ("auto", {"cpu"}, 4, 8, "gloo"),  # a CPU model on a GPU machine: Gloo
        ("auto", set(), 1, 0, "gloo"),  # nothing registered
        ("auto", {"cuda"}, 4, 8, "nccl"),  # a GPU each
        ("auto", {"cuda"}, 4, 1, "gloo"),  # four workers share one GPU: NCCL refuses
        ("gloo", {"cuda"}, 1, 1, "gloo"),
        ("nccl", {"cuda"}, 2, 2, "nccl"),
    ],
)
def test_choose_backend(backend, devices, local_world, gpus, want):
    got, why = choose_backend(backend, devices, local_world=local_world, gpus=gpus)
    assert got == want
    assert bool(why) == (backend == "auto" and "cuda" in devices and want == "gloo")


@pytest.mark.parametrize(
    "devices, local_world, gpus, match",
    [
        ({"cpu"}, 1, 1, "needs the model on a GPU"),
        ({"cuda"}, 2, 1, "needs one GPU per worker: 2 workers on this node, 1 GPU"),
    ],
)
def test_nccl_that_cannot_work_is_a_config_error(devices, local_world, gpus, match):
    with pytest.raises(ConfigError, match=match):
        choose_backend("nccl", devices, local_world=local_world, gpus=gpus)


def test_malloc_thresholds_are_fixed_on_glibc_unless_switched_off(monkeypatch):
    from fastft.process import malloc

    monkeypatch.setattr(malloc, "_done", None)
    assert malloc.tune({"FASTFT_MALLOC_TUNE": "0"}) is False
    assert malloc.tune({}) is False  # decided once per process
    monkeypatch.setattr(malloc, "_done", None)
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert malloc.tune({}) is glibc
