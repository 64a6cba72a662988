"""An epoch's view as every member holds it (:class:`EpochView`: its members, the step it
resumes from, who heals from whom) and its encoding in the store: members and ranks as
runs, so that a view of 16,384 members reads in a few hundred bytes (issue 64)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import Any

__all__ = ["MAX_RUN", "EpochView", "Member", "int_runs", "member_runs", "runs_ints", "runs_members"]


@dataclass(frozen=True, order=True)
class Member:
    """One life of one worker: its slot ``rank`` and ``incarnation``."""

    rank: int
    incarnation: int


_ORDER = attrgetter("rank", "incarnation")
"""Members' order as a key: a sort by it compares tuples in C, where ``order=True``'s
``__lt__`` is a Python call per comparison (every member sorts each view it reads: at 256
members, 65,000 calls of each formation's members over one host's cores)."""


def member_runs(members: Sequence[Member]) -> list[list[int]]:
    """``members`` (sorted by rank) as JSON runs: ``[rank, n, incarnation, d]`` for ``n``
    consecutive ranks whose incarnations step by ``d``, ``[rank, incarnation]`` alone. A
    first start's lives share one incarnation (:func:`first_incarnation`) and a node's
    restarted ones step by 1: a view of 16,384 members is a few runs, not 16,384 pairs
    that every joiner reads (O(N^2) bytes through the servers at a first start: issue 64)."""
    out: list[list[int]] = []
    i, n = 0, len(members)
    while i < n:
        m = members[i]
        j = i + 1
        if j < n and members[j].rank == m.rank + 1:
            d = members[j].incarnation - m.incarnation
            while (
                j < n
                and members[j].rank == m.rank + (j - i)
                and members[j].incarnation == m.incarnation + (j - i) * d
            ):
                j += 1
        if j - i > 2:
            out.append([m.rank, j - i, m.incarnation, d])
        else:
            j = i + 1
            out.append([m.rank, m.incarnation])
        i = j
    return out


def runs_members(runs: Iterable[Sequence[int]]) -> list[Member]:
    """:func:`member_runs` read back (a plain ``[rank, incarnation]`` list too)."""
    out = []
    for run in runs:
        if len(run) == 2:
            out.append(Member(int(run[0]), int(run[1])))
            continue
        r, n, inc, d = (int(v) for v in run)
        if not 0 < n <= MAX_RUN:
            raise ValueError(f"a run of {n} members")
        out.extend(Member(r + k, inc + k * d) for k in range(n))
    return out


def int_runs(values: Iterable[int]) -> list[int | list[int]]:
    """Sorted ranks as JSON: ``[lo, hi]`` for a range of three or more, else the rank."""
    out: list[int | list[int]] = []
    vs = list(values)
    i = 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        if j - i >= 2:
            out.append([vs[i], vs[j]])
        else:
            out.extend(vs[i : j + 1])
        i = j + 1
    return out


def runs_ints(runs: Iterable[int | Sequence[int]]) -> list[int]:
    """:func:`int_runs` read back."""
    out: list[int] = []
    for v in runs:
        if isinstance(v, int):
            out.append(v)
            continue
        lo, hi = int(v[0]), int(v[1])
        if not 0 <= hi - lo < MAX_RUN:
            raise ValueError(f"a range of ranks {lo}..{hi}")
        out.extend(range(lo, hi + 1))
    return out


MAX_RUN = 1 << 22
"""The most members a run may hold: a forged or broken view cannot ask for a list larger
than any world."""


@dataclass(frozen=True)
class EpochView:
    """An agreed epoch: its members (sorted by rank), the committed ``step`` it resumes
    from, the members that must receive state, and the member that sends it (None when
    no member holds the state). ``kept``: ``(rank, lo, hi, n)``
    for each survivor holding the weighted local gradient of samples ``[lo, hi)`` of
    ``step``'s batch of ``n`` (elastic worlds; see :mod:`fastft.protocol.shards`).
    ``waiting``: workers registered to join that this epoch left out (an elastic world's
    re-formation after a rollback: the survivors retry without waiting for their heal);
    they are admitted after the next commit. ``restore``: every member loads the durable
    checkpoint of this step (``step``) first. ``lost``: no live member held the committed
    state, which was at least this step (restored from ``restore``, started again from 0
    by ``source``, or :attr:`fatal`). ``rewind``: ``restore`` is the step of the state
    each member holds as verified by the replica check, which it loads instead of a
    durable checkpoint (a replica mismatch's repair)."""

    epoch: int
    members: tuple[Member, ...]
    step: int
    needs_state: frozenset[int]
    source: int | None
    kept: tuple[tuple[int, int, int, int], ...] = ()
    waiting: tuple[int, ...] = ()
    restore: int | None = None
    lost: int | None = None
    rewind: bool = False

    @property
    def fatal(self) -> bool:
        """No member holds the committed state and nothing can restore it: the job fails
        (or, with ``allow_fresh_start``, its members start again as new workers)."""
        return self.lost is not None and self.restore is None and self.source is None

    @cached_property
    def ranks(self) -> frozenset[int]:
        """(Made once: a message's routing asks for it several times, O(N) each.)"""
        return frozenset(m.rank for m in self.members)

    @cached_property
    def _at(self) -> dict[int, int]:
        """Each member's place (a survivor's round asks for every member's incarnation: a
        scan each was O(N^2) a round, seconds at 16,384 members; the scale model)."""
        at: dict[int, int] = {}
        for i, m in enumerate(self.members):
            at.setdefault(m.rank, i)
        return at

    def index(self, rank: int) -> int:
        """Dense rank of ``rank`` in this epoch's process group."""
        i = self._at.get(rank)
        if i is None:
            raise KeyError(f"rank {rank} is not a member of epoch {self.epoch}")
        return i

    def incarnation(self, rank: int) -> int:
        return self.members[self.index(rank)].incarnation

    def has(self, rank: int, incarnation: int) -> bool:
        i = self._at.get(rank)
        return i is not None and self.members[i].incarnation == incarnation

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "members": member_runs(self.members),
                "step": self.step,
                "needs_state": int_runs(sorted(self.needs_state)),
                "source": self.source,
                "kept": [list(k) for k in self.kept],
                "waiting": int_runs(self.waiting),
                **({"restore": self.restore} if self.restore is not None else {}),
                **({"lost": self.lost} if self.lost is not None else {}),
                **({"rewind": True} if self.rewind else {}),
            },
            separators=(",", ":"),
        )

    def change_from(self, prev: EpochView) -> str:
        """This view as a change of ``prev`` (JSON): the members that left and the lives
        that came in, and the rest of the view. A survivor of ``prev`` reads this, O(change)
        bytes, instead of the member list (issue 51: N members reading O(N) bytes each is
        O(N^2) through one server, ~5 GB a fault at 16,384)."""
        before = {m.rank: m.incarnation for m in prev.members}
        now = {m.rank: m.incarnation for m in self.members}
        d = json.loads(self.to_json())
        del d["members"]
        d["from"] = prev.epoch
        d["gone"] = int_runs(sorted(r for r, i in before.items() if now.get(r) != i))
        d["came"] = member_runs(
            sorted((Member(r, i) for r, i in now.items() if before.get(r) != i), key=_ORDER)
        )
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_change(cls, prev: EpochView, raw: str | bytes) -> EpochView | None:
        """The view a change of ``prev`` describes (:meth:`change_from`); None if it is a
        change of another epoch."""
        d = json.loads(raw)
        if int(d["from"]) != prev.epoch:
            return None
        gone = set(runs_ints(d["gone"]))
        members = [m for m in prev.members if m.rank not in gone]
        return cls._from_dict(d, members + runs_members(d["came"]))

    @classmethod
    def from_json(cls, raw: str | bytes) -> EpochView:
        d = json.loads(raw)
        return cls._from_dict(d, runs_members(d["members"]))

    @classmethod
    def _from_dict(cls, d: dict[str, Any], members: list[Member]) -> EpochView:
        return cls(
            epoch=int(d["epoch"]),
            members=tuple(sorted(members, key=_ORDER)),
            step=int(d["step"]),
            needs_state=frozenset(runs_ints(d["needs_state"])),
            source=None if d["source"] is None else int(d["source"]),
            kept=tuple(tuple(int(v) for v in k) for k in d.get("kept", ())),  # type: ignore[misc]
            waiting=tuple(runs_ints(d.get("waiting", ()))),
            restore=None if d.get("restore") is None else int(d["restore"]),
            lost=None if d.get("lost") is None else int(d["lost"]),
            rewind=bool(d.get("rewind", False)),
        )
