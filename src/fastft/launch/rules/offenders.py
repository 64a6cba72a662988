"""Repeat offenders: a worker slot that faults ``N`` times within ``S`` seconds
(``--quarantine N/S``, default 3 in 600 s) is quarantined. Its next life does not start
in place: a warm spare takes it, or the world shrinks without it (elastic), or the job
stops and says why (a fixed world with no spare). Pure: the agent feeds it the faults it
sees and acts on what it returns.

What counts as a fault of a slot: an exit the agent did not cause (a crash, a kill by a
peer's verdict, a hang, a failed health check; not a clean end, a drain, a fenced node or
a shard group taken down with a mate) and a Fault1 the worker reports about itself (an
in-process restart of :meth:`fastft.Runtime.run`, a ``StateLost`` raised in a step). A
transient Fault2 (an exception retried inside a step) does not: a peer's death can cause
one on an innocent worker."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from fastft.errors import ConfigError

__all__ = ["DEFAULT_QUARANTINE", "Offenders", "QuarantineRule"]

DEFAULT_QUARANTINE = "3/600"


@dataclass(frozen=True)
class QuarantineRule:
    faults: int
    window_s: float

    @classmethod
    def parse(cls, text: str) -> QuarantineRule | None:
        """``N/S`` (N faults within S seconds) or ``off``; a ConfigError otherwise."""
        if text.strip().lower() == "off":
            return None
        n, sep, s = text.partition("/")
        try:
            rule = cls(int(n), float(s)) if sep else None
        except ValueError:
            rule = None
        if rule is None or rule.faults < 1 or not 0 < rule.window_s <= 7 * 86400:
            raise ConfigError(
                f"--quarantine {text!r}: use N/S (N >= 1 faults within 0 < S <= 604800 "
                f"seconds, e.g. {DEFAULT_QUARANTINE}) or off"
            )
        return rule

    def __str__(self) -> str:
        return f"{self.faults} faults within {self.window_s:g} s"


@dataclass
class Offenders:
    """The faults of each slot within the rule's window, and the slots quarantined."""

    rule: QuarantineRule | None
    _times: dict[int, collections.deque[float]] = field(default_factory=dict)
    quarantined: dict[int, str] = field(default_factory=dict)
    """Rank -> why, until its next life starts (:meth:`replaced`)."""

    def fault(self, rank: int, now: float, what: str) -> str | None:
        """Count a fault of ``rank``'s slot at ``now``; returns why it is quarantined if
        this fault makes it a repeat offender (once: None while it stays quarantined)."""
        if self.rule is None:
            return None
        times = self._times.setdefault(rank, collections.deque())
        times.append(now)
        while times and times[0] < now - self.rule.window_s:
            times.popleft()
        if len(times) < self.rule.faults or rank in self.quarantined:
            return None
        why = (
            f"rank {rank} faulted {len(times)} times within {self.rule.window_s:g} s (last: {what})"
        )
        self.quarantined[rank] = why
        return why

    def quarantine(self, rank: int, why: str) -> bool:
        """Quarantine ``rank``'s slot for ``why`` now, whatever its count (a node's link
        taken out: :mod:`fastft.launch.gray.links`); False if it already is."""
        if rank in self.quarantined:
            return False
        self.quarantined[rank] = why
        return True

    def replaced(self, rank: int) -> None:
        """A new life took the quarantined slot's place: its count starts again."""
        self.quarantined.pop(rank, None)
        self._times.pop(rank, None)

    def count(self, rank: int) -> int:
        return len(self._times.get(rank, ()))
