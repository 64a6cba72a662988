"""fastft.lightning.resume's parts without Lightning: the train loader made resumable in
place (a restarted worker's epoch goes on at the batch after the last commit), and the
committed loop state a rollback leaves alone."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from fastft.lightning.resume import LoopState, resumable, why_not


def _loader(shuffle: bool = True) -> DataLoader:
    data = TensorDataset(torch.arange(40))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=shuffle, seed=3)
    return DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)


def test_a_resumed_epoch_goes_on_at_the_batch_after_the_last_commit():
    whole = [b[0].tolist() for b in _loader()]
    assert len(whole) == 5
    done = 2
    loader = resumable(_loader(), lambda: done)
    assert loader.state_dict() == {"batches": 2}  # (the position Lightning saves)
    fresh = resumable(_loader(), lambda: 0)
    fresh.load_state_dict({"batches": 2})
    assert [b[0].tolist() for b in fresh] == whole[2:]
    assert [b[0].tolist() for b in fresh] == whole  # the next pass is whole again
    assert len(fresh) == 5  # (Lightning counts the epoch's batches from its own loops)


def test_the_epoch_reaches_the_sampler_it_wraps():
    a, b = _loader(), resumable(_loader(), lambda: 0)
    a.sampler.set_epoch(4)
    b.batch_sampler.sampler.set_epoch(4)  # (Lightning sets the batch sampler's too)
    assert [x[0].tolist() for x in a] == [x[0].tolist() for x in b]
    b.load_state_dict({"batches": 3})
    assert [x[0].tolist() for x in b] == [x[0].tolist() for x in a][3:]


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(8)


def test_a_loader_that_cannot_be_resumed_says_why_and_one_with_its_own_state_is_kept():
    assert "IterableDataset" in str(why_not(DataLoader(Stream(), batch_size=2)))
    own = _loader()
    own.state_dict = lambda: {"mine": 1}  # (a StatefulDataLoader's shape)
    own.load_state_dict = lambda st: None
    assert why_not(own) is None and resumable(own, lambda: 5).state_dict() == {"mine": 1}
    assert "not a torch DataLoader" in str(why_not([1, 2]))


def test_a_rollback_restores_what_the_step_began_with_and_changes_nothing():
    loops = LoopState()
    loops.held = {"global_step": 4, "loops": {"fit_loop": {"x": 1}}}
    loops.load_state_dict({"global_step": 4, "loops": {"fit_loop": {"x": 1}}})
    assert loops.loaded is None  # (equal: a rollback's restore)
    healed = {"global_step": 7, "loops": {"fit_loop": {"x": 2}}}
    loops.load_state_dict(healed)
    assert loops.loaded == healed and loops.state_dict() == healed
    loops.held["loops"]["fit_loop"]["x"] = 3
    assert healed["loops"]["fit_loop"]["x"] == 2  # (a copy: the heal's buffers are not kept)
