"""Epoch formation, the decisions: who is admitted, who heals, who sends. Pure.

The store I/O around it (arrivals, joiner keys, the closing compare-and-set) is
:mod:`fastft.runtime.coordinator`; the protocol is described there.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from fastft.runtime.contract import EpochView, Member

__all__ = ["Arrival", "close_after", "close_first"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arrival:
    """A survivor's arrival at the next epoch: its life, its committed step, whether it
    lost its state, and the kept gradient ``(lo, hi, n)`` it holds of ``step``, if any."""

    incarnation: int
    step: int
    lost: bool
    kept: tuple[int, int, int] | None = None

    def to_json(self) -> str:
        d: dict[str, object] = {"inc": self.incarnation, "step": self.step, "lost": self.lost}
        if self.kept is not None and not self.lost:
            d["kept"] = list(self.kept)
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Arrival:
        d = json.loads(raw)
        kept = d.get("kept")
        return cls(
            int(d["inc"]),
            int(d["step"]),
            bool(d["lost"]),
            tuple(int(v) for v in kept) if kept else None,  # type: ignore[arg-type]
        )


def close_after(
    prev: EpochView,
    arrived: dict[int, Arrival],
    joiners: dict[int, int],
    *,
    expected: list[int],
    timed_out: bool,
    admit: bool,
    min_members: int,
) -> EpochView | None:
    """The view the closer of ``prev.epoch + 1`` writes, or None to wait: for the survivors
    it ``expected`` to arrive (until ``timed_out``), and for restarted workers while fewer
    than ``min_members`` take part. ``joiners``: registered joiners (rank -> incarnation)
    that did not arrive as survivors; ``admit`` False leaves them out (``waiting``) when the
    survivors are enough without them."""
    if not set(expected) <= set(arrived) and not timed_out:
        return None
    waiting: tuple[int, ...] = ()
    if not admit and joiners and len(arrived) >= min_members:
        waiting, joiners = tuple(sorted(joiners)), {}
    if len(arrived) + len(joiners) < min_members:
        return None  # wait for restarted workers
    members = [Member(r, a.incarnation) for r, a in arrived.items()]
    members += [Member(r, inc) for r, inc in joiners.items()]
    with_state = sorted(r for r, a in arrived.items() if not a.lost)
    needs = frozenset(joiners) | frozenset(r for r, a in arrived.items() if a.lost)
    steps = {a.step for a in arrived.values() if not a.lost}
    if len(steps) > 1:
        log.error("survivors disagree on the committed step: %s", steps)
    step = max(steps) if steps else 0
    kept = tuple(
        (r, *a.kept) for r, a in sorted(arrived.items()) if a.kept and not a.lost and a.step == step
    )
    return EpochView(
        epoch=prev.epoch + 1,
        members=tuple(sorted(members)),
        step=step,
        needs_state=needs if with_state else frozenset(),
        source=with_state[0] if with_state else None,
        kept=kept,
        waiting=waiting,
    )


def close_first(
    joiners: dict[int, int],
    *,
    me: int,
    latest: int,
    world_size: int,
    min_members: int,
    waited_s: float,
    start_timeout_s: float,
) -> EpochView | None:
    """The view joiner ``me`` writes when every slot is a joiner (the first start, or every
    worker was lost), or when the first start waited ``start_timeout_s`` with at least
    ``min_members``; None if it is not the one to close (or not yet). ``latest``: the last
    closed epoch (0: none)."""
    first_start = latest == 0
    everyone = len(joiners) == world_size
    enough_late = first_start and waited_s > start_timeout_s and len(joiners) >= min_members
    if not (everyone or enough_late) or min(joiners) != me:
        return None
    members = tuple(sorted(Member(r, inc) for r, inc in joiners.items()))
    source = members[0].rank
    return EpochView(
        epoch=latest + 1,
        members=members,
        step=0,
        # At the first start every worker built its model from the same seed; the lowest
        # sends its state anyway so that S3 holds from step 0.
        needs_state=frozenset(m.rank for m in members) - {source},
        source=source,
    )
