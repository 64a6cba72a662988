"""Who computes which samples of a step's global batch (pure; no I/O).

A step's global batch of ``n`` samples is tiled over the epoch's members in contiguous,
balanced ranges (:func:`tile`). When the world shrinks in the middle of a step, the
survivors that had already finished their part kept a copy of their weighted local
gradient (the runtime's *kept* gradients, elastic worlds only). The retry then need not
compute those samples again: :func:`plan` leaves each kept range with its holder and
splits only the uncovered samples, the lost members' part, over every member of the new
epoch. Each sample of the committed step is still counted exactly once (S5 up to summation
order, as for any change of the world).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Range", "ShardPlan", "tile", "plan"]

Range = tuple[int, int]
"""Half-open ``[lo, hi)`` sample range."""


def tile(lo: int, hi: int, world: int, index: int) -> Range:
    """Member ``index``'s part of ``[lo, hi)`` split over ``world`` members: contiguous
    and balanced, the first ``(hi - lo) % world`` members take one more."""
    per, extra = divmod(hi - lo, world)
    a = lo + index * per + min(index, extra)
    return a, a + per + (1 if index < extra else 0)


@dataclass(frozen=True)
class ShardPlan:
    """One attempt's assignment: ``pieces[i]`` is what member ``i`` computes now;
    ``kept[i]``, when present, is the range whose kept gradient member ``i`` adds."""

    pieces: tuple[Range, ...]
    kept: Mapping[int, Range]


def plan(n: int, world: int, offered: Mapping[int, tuple[int, int, int]]) -> ShardPlan:
    """The assignment for ``world`` members (dense indices) of a batch of ``n`` samples,
    given the kept gradients ``offered`` by member index as ``(lo, hi, n)``.

    Offers are taken in index order when they are for this ``n``, well formed and
    disjoint from those taken before (two offers can overlap when they come from
    attempts tiled over different worlds). Kept ranges are used only if the samples they
    leave uncovered form one non-empty contiguous range with at least one sample per
    member; otherwise the attempt is a plain :func:`tile` of the whole batch."""
    if n < world:
        raise ValueError(f"a global batch of {n} samples cannot feed {world} members")
    plain = ShardPlan(tuple(tile(0, n, world, i) for i in range(world)), {})
    taken: dict[int, Range] = {}
    for i in sorted(offered):
        lo, hi, of_n = offered[i]
        if not 0 <= i < world or of_n != n or not 0 <= lo < hi <= n:
            continue
        if all(hi <= a or lo >= b for a, b in taken.values()):
            taken[i] = (lo, hi)
    if not taken:
        return plain
    gaps: list[Range] = []
    at = 0
    for lo, hi in sorted(taken.values()):
        if lo > at:
            gaps.append((at, lo))
        at = hi
    if at < n:
        gaps.append((at, n))
    if len(gaps) != 1 or gaps[0][1] - gaps[0][0] < world:
        return plain
    a, b = gaps[0]
    return ShardPlan(tuple(tile(a, b, world, i) for i in range(world)), taken)
