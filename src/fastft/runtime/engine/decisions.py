"""The decision's encoding in the store, and the compare-and-set that makes it once.

``decision(e, s)`` holds ``C`` (commit), ``CJ`` (commit, then re-form to admit waiting
workers), ``C...L1,3`` (commit; ranks 1 and 3 leave after it) or ``R<reason>`` (roll back).
The first compare-and-set into the empty key is the decision (S2); every member reads it.
"""

from __future__ import annotations

from typing import Any

from fastft.bus.signed import ForgedValue
from fastft.errors import ControlPlaneError
from fastft.protocol.keys import JobKeys

__all__ = [
    "ADMIT",
    "COMMIT",
    "JOIN_FLAG",
    "LEAVE",
    "LEAVE_FLAG",
    "ROLLBACK",
    "decide_once",
    "forget",
    "parse_commit",
    "propose_rollback",
]

COMMIT = "C"
ADMIT = "J"
"""Suffix of a commit decision: re-form the epoch after it to admit waiting workers."""
ROLLBACK = "R"
JOIN_FLAG = 1 << 20
"""Added to a vote by a member that saw a join request (epochs have fewer members)."""
LEAVE = "L"
"""In a commit decision: the ranks that leave after it (drained), ``L1,3``."""
LEAVE_FLAG = 1 << 40
"""Added to a vote by a member that leaves after the step (a drain)."""
_REPLACE_FORGED = 8
"""Forged values one compare-and-set replaces before it gives up (ControlPlaneError)."""


def parse_commit(decision: str) -> tuple[bool, frozenset[int]] | None:
    """A commit decision's (admit, leaving ranks); None for a rollback (or garbage)."""
    if decision[:1] != COMMIT:
        return None
    rest = decision[1:]
    admit = rest.startswith(ADMIT)
    rest = rest.removeprefix(ADMIT)
    if not rest:
        return admit, frozenset()
    if not rest.startswith(LEAVE):
        return None
    parts = rest[1:].split(",") if rest[1:] else []
    if not all(p.isdigit() for p in parts):
        return None
    return admit, frozenset(int(p) for p in parts)


def decide_once(store: Any, key: str, desired: str) -> str:
    """Compare-and-set ``desired`` into an empty ``key``; the value that holds. A value
    without the job secret's tag that got there first is no decision: it is replaced
    (a signed store raises ForgedValue for it; docs/security.md)."""
    try:
        return bytes(store.compare_set(key, "", desired)).decode(errors="replace")
    except ForgedValue as f:
        forged = f.raw
    for _ in range(_REPLACE_FORGED):
        try:
            return bytes(store.replace(key, forged, desired)).decode(errors="replace")
        except ForgedValue as f:
            forged = f.raw
    raise ControlPlaneError(f"store key {key} is rewritten without the job secret, again and again")


def propose_rollback(store: Any, keys: JobKeys, epoch: int, step: int, reason: str) -> str:
    """Compare-and-set ROLLBACK as the decision of (epoch, step); the decision that holds."""
    return decide_once(store, keys.decision(epoch, step), ROLLBACK + reason[:200])


def forget(store: Any, keys: JobKeys, epoch: int, step: int) -> None:
    """Delete the keys of a decided step nobody reads any more."""
    for key in (keys.votes(epoch, step), keys.decision(epoch, step)):
        store.delete_key(key)
