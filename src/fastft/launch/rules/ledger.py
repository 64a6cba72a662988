"""The agent's ledger: what it has done to the lives of its node (restarts, lives fenced,
taken down with their shard group or replaced as stragglers, shard-group generations,
whether each rank's first life failed before its first commit). One object with one owner: the agent holds it; its
parts (:mod:`.exits`, :mod:`.nodewatch`) read it and change it only through its methods,
each a named step of the agent's course. Pure: no torch, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fastft.launch.rules import policy

__all__ = ["Ledger"]


class Ledger:
    def __init__(self, ranks: Iterable[int]) -> None:
        self._restarts = 0
        self._first: dict[int, bool | None] = {r: None for r in ranks}
        self._fenced: set[int] = set()
        self._taken_down: set[int] = set()
        self._gen: dict[int, int] = {}
        self._replaced: set[int] = set()

    @property
    def restarts(self) -> int:
        """Worker restarts this agent made (every slot)."""
        return self._restarts

    @property
    def first_lives(self) -> Mapping[int, bool | None]:
        """Rank -> whether its first life failed before its first commit (None: running)."""
        return self._first

    def restarted(self) -> None:
        self._restarts += 1

    def first_life_ended(self, rank: int, *, failed: bool) -> bool:
        """``rank``'s first life ended (``failed``: before its first commit); True if it
        was the first life's end (later calls change nothing)."""
        if rank not in self._first or self._first[rank] is not None:
            return False
        self._first[rank] = failed
        return True

    def startup_failed(self) -> bool:
        """Every rank's first life failed before its first commit (:mod:`.policy`)."""
        return policy.startup_failed(self._first)

    def fence(self, incarnation: int) -> None:
        """A life killed because this node was declared lost (not the script's failure)."""
        self._fenced.add(incarnation)

    def fenced(self, incarnation: int) -> bool:
        return incarnation in self._fenced

    def take_down(self, group: int, incarnations: Iterable[int]) -> int:
        """Lives killed because their shard group starts again, as a whole; the group's
        next generation (the prefix its members meet under)."""
        self._taken_down.update(incarnations)
        self._gen[group] = self._gen.get(group, 0) + 1
        return self._gen[group]

    def taken_down(self, incarnation: int) -> bool:
        """A life the agent killed with its group (its exit restarts no group)."""
        return incarnation in self._taken_down

    @property
    def down(self) -> frozenset[int]:
        """Every life taken down with its group."""
        return frozenset(self._taken_down)

    def generation(self, group: int) -> int:
        """How many times the agent started shard group ``group`` again."""
        return self._gen.get(group, 0)

    def replace(self, incarnation: int) -> None:
        """A life asked to drain as a straggler (:mod:`.stragglers`): its exit starts the
        slot again, in an elastic world too."""
        self._replaced.add(incarnation)

    def replaced(self, incarnation: int) -> bool:
        return incarnation in self._replaced
