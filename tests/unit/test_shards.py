"""Who computes which samples of a step (fastft.protocol.shards): plain tiling, and the
retry of a step the world shrank in, where survivors add the gradient they kept."""

from __future__ import annotations

import itertools

import pytest

from fastft.protocol.shards import plan, tile


def covered(n: int, world: int, offered: dict[int, tuple[int, int, int]]) -> list[int]:
    """How many times each sample is counted by the plan's pieces and kept ranges."""
    p = plan(n, world, offered)
    count = [0] * n
    for lo, hi in [*p.pieces, *p.kept.values()]:
        for i in range(lo, hi):
            count[i] += 1
    return count


def test_tile_is_contiguous_and_balanced():
    parts = [tile(0, 10, 3, i) for i in range(3)]
    assert parts == [(0, 4), (4, 7), (7, 10)]
    assert [tile(64, 96, 2, i) for i in range(2)] == [(64, 80), (80, 96)]


def test_no_offer_is_a_plain_tiling():
    p = plan(96, 2, {})
    assert p.pieces == ((0, 48), (48, 96)) and p.kept == {}


def test_survivors_keep_their_parts_and_split_the_lost_one():
    # 3 members tiled 96 samples; member 2 (samples 64..96) died; the survivors kept theirs
    p = plan(96, 2, {0: (0, 32, 96), 1: (32, 64, 96)})
    assert p.kept == {0: (0, 32), 1: (32, 64)}
    assert p.pieces == ((64, 80), (80, 96))


def test_the_lost_part_in_the_middle_or_first():
    assert plan(96, 2, {0: (0, 32, 96), 1: (64, 96, 96)}).pieces == ((32, 48), (48, 64))
    assert plan(96, 2, {0: (32, 64, 96), 1: (64, 96, 96)}).pieces == ((0, 16), (16, 32))


def test_a_survivor_that_kept_nothing_gets_a_piece_only():
    # member 1 was interrupted before its part was done: its samples are uncovered too
    p = plan(96, 2, {0: (0, 32, 96)})
    assert p.kept == {0: (0, 32)} and p.pieces == ((32, 64), (64, 96))


@pytest.mark.parametrize(
    "offered",
    [
        {0: (0, 32, 64)},  # another global batch size
        {0: (0, 96, 96), 1: (0, 0, 96)},  # everything covered: nobody would compute
        {0: (32, 64, 96)},  # gaps on both sides
        {0: (0, 95, 96)},  # one uncovered sample for two members
        {0: (5, 3, 96)},  # malformed
    ],
)
def test_unusable_offers_fall_back_to_a_plain_tiling(offered):
    p = plan(96, 2, offered)
    assert p.kept == {} and p.pieces == ((0, 48), (48, 96))


def test_overlapping_offers_from_different_tilings_take_the_first():
    # member 0 kept 0..48 (a tiling over 2); member 1 still holds 32..64 (over 3)
    p = plan(96, 2, {0: (0, 48, 96), 1: (32, 64, 96)})
    assert p.kept == {0: (0, 48)} and p.pieces == ((48, 72), (72, 96))


def test_every_sample_counted_once_for_any_offers():
    n = 12
    ranges = [(lo, hi) for lo, hi in itertools.combinations(range(n + 1), 2)][::5]
    for world in (1, 2, 3):
        for picks in itertools.product([None, *ranges], repeat=world):
            offered = {i: (r[0], r[1], n) for i, r in enumerate(picks) if r is not None}
            assert covered(n, world, offered) == [1] * n, (world, offered)
            p = plan(n, world, offered)
            assert all(hi > lo for lo, hi in p.pieces), "nobody gets an empty part"


def test_too_small_a_batch_is_an_error():
    with pytest.raises(ValueError, match="cannot feed"):
        plan(1, 2, {})
