"""fastft.Batches (issue 19): a rollback serves the step's batches again without going
through the loader; a heal or a restore loads the loader's state; every batch counts once.
A fake loader stands in for a StatefulDataLoader (the fault tier runs the real one)."""

from __future__ import annotations

import copy

import pytest

from fastft import Batches


class Loader:
    """Batches 0..n-1 per epoch, numbered across epochs; counts loads and state reads."""

    def __init__(self, n: int = 5) -> None:
        self.n, self.pos, self.loads, self.reads = n, 0, 0, 0

    def __iter__(self):
        epoch_end = (self.pos // self.n + 1) * self.n
        while self.pos < epoch_end:
            self.pos += 1
            yield self.pos - 1

    def state_dict(self):
        self.reads += 1
        return {"pos": self.pos}

    def load_state_dict(self, st):
        self.loads += 1
        self.pos = st["pos"]


def _run(b: Batches, steps: int, rollback_at: set[int], draws: int = 1) -> list[int]:
    """A step loop: snapshot, draw, and at the given steps a rollback and a retry."""
    got = []
    for s in range(steps):
        snap = copy.deepcopy(b.state_dict())
        drawn = [b.next() for _ in range(draws)]
        if s in rollback_at:
            b.load_state_dict(copy.deepcopy(snap))
            drawn = [b.next() for _ in range(draws)]
        got += drawn
    return got


@pytest.mark.parametrize("draws", [1, 3])
def test_a_rollback_serves_the_same_batches_again_without_the_loader(draws):
    loader = Loader()
    b = Batches(loader)
    assert _run(b, 12, {0, 4, 5, 11}, draws) == list(range(12 * draws))
    assert loader.loads == 0
    assert b.epoch == (12 * draws - 1) // 5


def test_a_heal_loads_the_loader_state_and_goes_on_from_it():
    donor = Batches(Loader())
    _run(donor, 7, {3})
    snap = copy.deepcopy(donor.state_dict())
    fresh_loader = Loader()
    healed = Batches(fresh_loader)
    healed.load_state_dict(snap)
    assert fresh_loader.loads == 1
    assert healed.state_dict() == snap and fresh_loader.reads == 0  # not asked before a draw
    assert [healed.next() for _ in range(4)] == [donor.next() for _ in range(4)] == [7, 8, 9, 10]
    assert healed.epoch == donor.epoch == 2
    # the healed member's own rollbacks then work the same way
    assert _run(healed, 3, {1}) == [11, 12, 13]


def test_a_retry_that_draws_less_catches_the_loader_up():
    loader = Loader()
    b = Batches(loader)
    snap = copy.deepcopy(b.state_dict())
    assert [b.next() for _ in range(3)] == [0, 1, 2]
    b.load_state_dict(copy.deepcopy(snap))
    assert b.next() == 0  # the retry takes one of the three
    assert b.state_dict()["pos"] == 1 and loader.pos == 1  # the loader was brought back
    assert [b.next() for _ in range(3)] == [1, 2, 3]


def test_a_rollback_past_what_was_kept_loads_the_loader():
    loader = Loader()
    b = Batches(loader)
    old = copy.deepcopy(b.state_dict())
    _run(b, 4, set())
    b.state_dict()
    b.next()
    b.load_state_dict(copy.deepcopy(old))  # from before the last two states: not kept
    assert loader.loads == 1 and b.next() == 0


def test_a_loader_without_state_is_refused_with_what_to_use():
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        Batches([1, 2, 3])  # type: ignore[arg-type]


def _sdl(workers: int = 0):
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    return sdl.StatefulDataLoader(
        list(range(10)),
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )


def test_each_pass_is_the_same_however_often_the_loader_was_restored():
    """A StatefulDataLoader with num_workers=0 restored from any state reshuffled its next
    pass differently from one never restored (issue 40): members healed at different
    steps drew different batches. Through Batches, every restore history gives one stream."""
    n = 14  # nearly five passes of three batches (4, 4, 2)
    whole = Batches(_sdl())
    ref = [whole.next().tolist() for _ in range(n)]
    assert ref[:3] != ref[3:6], "the passes should be shuffled apart"
    for k in range(n):
        a = Batches(_sdl())
        got = [a.next().tolist() for _ in range(k)]
        b = Batches(_sdl())
        b.load_state_dict(copy.deepcopy(a.state_dict()))  # a heal at k
        got += [b.next().tolist() for _ in range(2)]
        c = Batches(_sdl())
        c.load_state_dict(copy.deepcopy(b.state_dict()))  # and another, two batches on
        got += [c.next().tolist() for _ in range(n - len(got))]
        assert got[:n] == ref, f"healed at batch {k}"


def test_a_healed_member_shuffles_with_the_seed_it_was_sent():
    """The pass seeds travel in the state: a member whose loader was seeded otherwise
    draws what the member it healed from draws, on every later pass."""
    torch = pytest.importorskip("torch")
    src = Batches(_sdl())
    other = _sdl()
    other.generator.manual_seed(7)
    dst = Batches(other)
    dst.load_state_dict(copy.deepcopy(src.state_dict()))
    assert [dst.next().tolist() for _ in range(9)] == [src.next().tolist() for _ in range(9)]
    assert isinstance(other.generator, torch.Generator)


def test_the_batch_digest_sees_content_order_and_shape():
    from fastft.runtime.state.data import batch_digest

    torch = pytest.importorskip("torch")
    x = torch.arange(12.0).reshape(3, 4)
    d = batch_digest((x, [1, 2]))
    assert d == batch_digest((x.clone(), [1, 2])) and 0 <= d < 1 << 62
    assert d != batch_digest((x.reshape(4, 3), [1, 2]))
    assert d != batch_digest((x.flip(0), [1, 2]))
    assert d != batch_digest((x, [2, 1]))
    big = torch.zeros(3 << 20)  # 12 MB: sampled, and a changed sampled element still shows
    before = batch_digest(big)
    big[0] = 1.0
    assert batch_digest(big) != before


def test_a_step_digest_covers_every_batch_the_step_drew():
    b = Batches(Loader())
    b.start_step()
    assert b.digest is None
    b.next()
    one = b.digest
    b.next()
    assert b.digest not in (None, one)
    b.start_step()
    assert b.digest is None


def test_a_stateful_loader_built_after_import_fastft_warns_nothing():
    """torchdata's deprecated torch.set_vital call warned at every worker life (issue 53)."""
    import subprocess
    import sys

    code = (
        "import fastft\n"
        "from torchdata.stateful_dataloader import StatefulDataLoader\n"
        "StatefulDataLoader(list(range(4)))\n"
    )
    r = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "set_vital" not in r.stderr, r.stderr
