"""Shard groups (issue 22): who reduces with whom, who heals whom, which lives the agent
takes down with a faulty member, and the configurations refused at start."""

from __future__ import annotations

import pytest

from fastft.errors import ConfigError
from fastft.launch.rules.policy import group_mates
from fastft.launch.settings.config import LaunchConfig
from fastft.protocol.auth import JobSecret
from fastft.runtime.contract import EpochView, Member, RuntimeConfig
from fastft.runtime.groups.hsdp import (
    broken_groups,
    heal_group,
    replicate_ranks,
    shard_source,
    whole_groups,
)


def _view(n: int, needs: set[int], source: int | None) -> EpochView:
    members = tuple(Member(r, 100 + r) for r in range(n))
    return EpochView(2, members, 8, frozenset(needs), source)


def test_the_replicate_group_is_the_shard_index_across_groups():
    v = _view(6, set(), None)  # 3 groups of 2
    assert replicate_ranks(v, 4, 2) == [0, 2, 4]
    assert replicate_ranks(v, 3, 2) == [1, 3, 5]
    assert replicate_ranks(v, 3, 1) == list(range(6))  # one worker per replica: everyone


def test_a_restarted_group_heals_each_shard_from_its_own_index():
    v = _view(4, {0, 1}, 2)  # group 0 restarted; the epoch's source is rank 2
    assert [shard_source(v, r, 2) for r in range(4)] == [2, 3, 2, 3]
    assert heal_group(v, 0, 2) == [2, 0] and heal_group(v, 2, 2) == [2, 0]
    assert heal_group(v, 1, 2) == [3, 1] and heal_group(v, 3, 2) == [3, 1]
    v6 = _view(6, {2, 3}, 0)  # group 1 of 3 restarted: the lowest holder of each index sends
    assert heal_group(v6, 4, 2) is None  # a bystander
    assert heal_group(v6, 5, 2) is None
    assert heal_group(v6, 3, 2) == [1, 3]


def test_at_the_first_start_the_lowest_member_of_each_index_sends():
    v = _view(4, {1, 2, 3}, 0)
    assert heal_group(v, 2, 2) == [0, 2]
    assert heal_group(v, 3, 2) == [1, 3]  # rank 1 built its shard from the same seed


def test_one_worker_per_replica_heals_as_before():
    v = _view(3, {1}, 0)
    assert shard_source(v, 2, 1) == 0
    assert heal_group(v, 1, 1) == [0, 1] and heal_group(v, 2, 1) is None
    assert heal_group(_view(3, set(), 0), 0, 1) is None


def test_the_agent_takes_the_whole_group_down_once():
    lives = {0: 10, 1: 11, 2: 12, 3: 13}
    assert group_mates(1, 11, 2, lives, set()) == [0]
    assert group_mates(2, 12, 2, lives, set()) == [3]
    assert group_mates(0, 10, 2, lives, {10}) is None  # its exit was the agent's doing
    assert group_mates(1, 11, 1, lives, set()) is None  # no shard groups
    assert group_mates(5, 15, 3, {3: 1, 4: 2, 5: 15}, set()) == [3, 4]


def _runtime(**kw) -> RuntimeConfig:
    return RuntimeConfig(store="h:1", job="j", rank=0, world_size=4, **kw)


def test_bad_shard_groups_are_refused_with_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match="does not divide the 4 workers"):
        _runtime(shard_size=3)
    with pytest.raises(ConfigError, match="multiple of the group size"):
        _runtime(shard_size=2, min_replicas=3)
    assert _runtime(shard_size=2, min_replicas=2).elastic
    with pytest.raises(ConfigError, match="durable tier does not save shard groups"):
        _runtime(shard_size=2, checkpoint_dir="/tmp/x")
    assert _runtime(shard_size=2).shard_size == 2
    with pytest.raises(ConfigError, match="does not divide --nproc 4"):
        LaunchConfig(command=("t.py",), nproc=4, shard_size=3)
    with pytest.raises(ConfigError, match="does not divide --nproc 4"):
        secret = str(JobSecret.draw().save(tmp_path / "s"))
        LaunchConfig(command=("t.py",), nproc=4, nnodes=2, shard_size=8, store="h:1",
                     job_secret_file=secret)  # fmt: skip


def test_an_epoch_admits_whole_groups_and_waits_for_no_broken_one():
    v = _view(6, set(), 0)
    assert broken_groups(v, {Member(3, 103)}, 2) == {1}
    assert broken_groups(v, {Member(3, 999)}, 2) == set()  # a life that is not a member
    assert broken_groups(v, {Member(3, 103)}, 1) == set()
    assert whole_groups([0, 1, 2, 4, 5], 2) == {0, 1, 4, 5}
    assert whole_groups([3, 4, 5], 3) == {3, 4, 5}


def test_sync_policies_are_parsed_or_refused_with_what_to_use():
    assert _runtime(sync="per-step").sync_every == 1
    assert _runtime(sync="every-k:8", shard_size=2).sync_every == 8
    assert _runtime(sync="diloco:4").sync_every == 4
    assert _runtime(sync="diloco:4").sync_kind == "diloco"
    for bad in ("every-k:0", "every-k", "every-3", "sometimes", "diloco", "diloco:x"):
        with pytest.raises(ConfigError, match="use per-step, every-k:N or diloco:N"):
            _runtime(sync=bad)


def test_an_outer_step_moves_the_anchor_and_the_parameters_and_a_rollback_undoes_it():
    """DiLoCo's outer step (fastft.runtime.sync.Outer) on two parameters; against the
    formula for plain SGD (lr 0.5): anchor - 0.5 * averaged pseudo-gradient."""
    import copy

    import torch

    from fastft.runtime.state.outer import Outer

    params = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    outer = Outer(params, lambda ps: torch.optim.SGD(ps, lr=0.5))
    with torch.no_grad():  # the group's local steps moved the parameters
        params[0].sub_(torch.tensor([0.2, 0.4]))
        params[1].add_(1.0)
    delta = outer.pseudo_gradient()
    assert torch.allclose(delta, torch.tensor([0.2, 0.4, -1.0]))
    before = [p.clone() for p in params]
    outer.step(delta * 2)  # as if the other group's move were the same again
    assert torch.allclose(params[0], torch.tensor([0.8, 1.6]))
    assert torch.allclose(params[1], torch.tensor([4.0]))
    assert all(torch.equal(a, p) for a, p in zip(outer.anchor, params, strict=True))
    outer.rollback()  # the step it began did not commit
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert torch.equal(outer.anchor[0], torch.tensor([1.0, 2.0]))
    saved = copy.deepcopy(outer.state_dict())  # (live tensors, as a module's state_dict)
    outer.step(delta)
    outer.committed()
    outer.rollback()  # nothing to undo once committed
    assert torch.allclose(params[1], torch.tensor([3.5]))
    other = Outer([torch.zeros(2), torch.zeros(1)])  # (Nesterov SGD, as a heal loads it)
    other.load_state_dict(saved)
    assert torch.equal(other.anchor[1], torch.tensor([3.0]))
