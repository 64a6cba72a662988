"""``fastft.ray``'s settings in Ray Train's spellings (issue 62): Ray's field names mapped
onto node agents, restarts and kept checkpoints; Ray Train's own objects read field by
field; the reported checkpoints kept by score or recency."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastft.ray import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, Trainer
from fastft.ray.configs import UNLIMITED, coerce
from fastft.ray.trainer import _kept


def test_num_workers_become_node_agents_with_their_resources():
    s = ScalingConfig(num_workers=4, resources_per_worker={"CPU": 2, "GPU": 1})
    assert (s.num_nodes, s.workers_per_node, s.gpus_per_node, s.cpus_per_node) == (4, 1, 1, 3)
    assert s.placement == "spread" and s.total_workers == 4
    packed = ScalingConfig(num_workers=4, workers_per_node=2, use_gpu=True)
    assert (packed.num_nodes, packed.gpus_per_node) == (2, 2.0)
    with pytest.raises(ValueError, match="fill whole nodes"):
        ScalingConfig(num_workers=3, workers_per_node=2)
    with pytest.raises(ValueError, match="num_workers=0"):
        ScalingConfig(num_workers=0)


def test_max_failures_bounds_worker_restarts_and_node_replacements():
    f = FailureConfig(max_failures=2)
    assert (f.max_worker_restarts, f.max_node_restarts) == (2, 2)
    assert FailureConfig(max_failures=-1).max_worker_restarts == UNLIMITED
    assert FailureConfig(max_failures=1, max_worker_restarts=5).max_worker_restarts == 5
    with pytest.raises(ValueError, match="max_failures=-2"):
        FailureConfig(max_failures=-2)


def test_the_run_configs_failure_and_checkpoint_settings_reach_the_flags(tmp_path):
    rc = RunConfig(
        checkpoint_every=5,
        failure_config=FailureConfig(max_failures=3),
        checkpoint_config=CheckpointConfig(num_to_keep=2),
    )
    t = Trainer(lambda: None, run_config=rc)
    flags = t.fastft_flags(tmp_path)
    assert flags[flags.index("--max-restarts") + 1] == "3"
    assert flags[flags.index("--checkpoint-keep") + 1] == "2"
    assert t.failure.max_node_restarts == 3
    with pytest.raises(ValueError, match="Ray Data shards are not built"):
        Trainer(lambda: None, datasets={"train": object()})


@dataclass
class ScalingConfigLike:  # Ray Train's fields (ray.train is not installed here)
    num_workers: int
    use_gpu: bool = False
    resources_per_worker: dict | None = None
    trainer_resources: dict | None = None


ScalingConfigLike.__name__ = "ScalingConfig"


@dataclass
class RunConfigLike:
    name: str
    storage_path: Path
    failure_config: object = None
    checkpoint_config: object = None
    verbose: int = 1


RunConfigLike.__name__ = "RunConfig"


def test_ray_trains_own_objects_are_read_field_by_field(tmp_path):
    s = coerce(ScalingConfigLike(num_workers=2, use_gpu=True), ScalingConfig)
    assert s is not None and (s.num_nodes, s.gpus_per_node) == (2, 1.0)
    fc = FailureConfig(max_failures=1)
    rc = coerce(RunConfigLike("x", tmp_path, failure_config=fc), RunConfig)
    assert rc is not None and rc.storage_path == str(tmp_path) and rc.failure_config == fc
    with pytest.raises(TypeError, match="expected fastft.ray.ScalingConfig or Ray Train's"):
        coerce(object(), ScalingConfig)


def test_the_kept_reported_checkpoints_are_the_best_by_score_and_the_rest_removed(tmp_path):
    ev = []
    for i, loss in enumerate([0.5, 0.2, 0.4, 0.3]):
        d = tmp_path / f"000-{i:06d}"
        d.mkdir()
        ev.append(
            {
                "event": "train_report",
                "rank": 0,
                "t": float(i),
                "checkpoint": str(d),
                "metrics": {"loss": loss, "step": i},
            }
        )
    best = _kept(ev, CheckpointConfig(2, "loss", "min"))
    assert [m["step"] for _, m in best] == [1, 3]
    assert sorted(os.listdir(tmp_path)) == ["000-000001", "000-000003"]
    newest = _kept(ev, CheckpointConfig(1))
    assert [m["step"] for _, m in newest] == [3]
