"""An epoch's view in the store (issue 64): members and ranks as runs, read back exactly;
a first start's view of 16,384 members in a few hundred bytes."""

from __future__ import annotations

import json
import random

import pytest

from fastft.runtime.view import (
    EpochView,
    Member,
    int_runs,
    member_runs,
    runs_ints,
    runs_members,
)


def _view(members, **kw):
    return EpochView(7, tuple(sorted(members)), 12, frozenset(kw.pop("needs", ())), 0, **kw)


@pytest.mark.parametrize("seed", range(30))
def test_any_view_reads_back_as_it_was(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 300)
    ranks = sorted(rng.sample(range(n * 2), n))
    base = rng.choice([1, rng.getrandbits(62) | 1])
    members = [
        Member(r, rng.choice([base, base + r, rng.getrandbits(62) | 1, base - r])) for r in ranks
    ]
    needs = rng.sample(ranks, rng.randrange(0, n + 1))
    view = _view(members, needs=needs, waiting=tuple(sorted(rng.sample(range(999), 5))))
    assert EpochView.from_json(view.to_json()) == view
    assert runs_members(member_runs(view.members)) == list(view.members)
    assert runs_ints(int_runs(sorted(needs))) == sorted(needs)


def test_a_first_start_of_16384_is_a_few_hundred_bytes_and_a_change_too():
    inc = random.Random(1).getrandbits(62) | 1  # (every first life of a job shares it)
    first = _view([Member(r, inc) for r in range(16384)], needs=range(1, 16384))
    raw = first.to_json()
    assert len(raw) < 300, raw
    assert EpochView.from_json(raw) == first
    # rank 5 restarted (a new life), rank 9 gone: the next epoch as a change of the first
    members = [Member(r, 77 if r == 5 else inc) for r in range(16384) if r != 9]
    nxt = EpochView(8, tuple(members), 40, frozenset({5}), 0)
    change = nxt.change_from(first)
    assert len(change) < 300 and len(nxt.to_json()) < 400
    assert EpochView.from_change(first, change) == nxt


def test_a_node_of_restarted_lives_is_one_run():
    # (a node's agent numbers its lives: its ranks' incarnations step by 1)
    assert member_runs([Member(8 + k, 1000 + k) for k in range(8)]) == [[8, 8, 1000, 1]]
    assert member_runs([Member(0, 3), Member(1, 9)]) == [[0, 3], [1, 9]]


def test_a_run_larger_than_any_world_is_refused():
    raw = json.loads(_view([Member(0, 1)]).to_json())
    raw["members"] = [[0, 1 << 30, 1, 0]]
    with pytest.raises(ValueError, match="a run of"):
        EpochView.from_json(json.dumps(raw))
    raw["members"], raw["needs_state"] = [[0, 1]], [[0, 1 << 30]]
    with pytest.raises(ValueError, match="a range of ranks"):
        EpochView.from_json(json.dumps(raw))


def test_the_first_lives_of_every_node_share_a_base_and_a_later_agent_draws_its_own():
    from fastft.launch.control import first_lives_base
    from fastft.protocol import JobKeys
    from fastft.testing.store import MemoryStore

    store, keys = MemoryStore(), JobKeys("j")
    a, b = first_lives_base(store, keys, 0), first_lives_base(store.clone(), keys, 1)
    assert a == b and 0 < a < 1 << 61  # (rank r's first life: a + r, one run in a view)
    again = first_lives_base(store, keys, 1)  # (node 1's agent started again)
    assert again != a
    store.set(keys.first_lives, "not a number")  # (a broken value: drawn afresh, no crash)
    assert first_lives_base(store, JobKeys("j"), 2) > 0
