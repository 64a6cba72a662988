"""A lost node's mark and the worker lives it names (:mod:`fastft.launch.nodes.lease`): the
lease value that stopped, the node that saw it stop, and ``rank:incarnation`` pairs."""

from __future__ import annotations

from typing import Any

from fastft.bus.signed import ForgedValue
from fastft.protocol.keys import JobKeys

__all__ = [
    "declared_lives",
    "format_lives",
    "lost_mark",
    "mark_counter",
    "mark_lost",
    "parse_lives",
    "put_mark",
]


def lost_mark(counter: int, by: int, lives: dict[int, int]) -> str:
    """A node's lost mark: the lease value that stopped, the node that saw it stop, and the
    worker lives it declared dead, which are the only ones the node's fence kills."""
    return f"{counter}@{by}/{format_lives(lives)}"


def mark_counter(mark: str) -> int:
    """The lease value a lost mark says stopped (0 if it names none)."""
    head = mark.partition("@")[0]
    return int(head) if head.isdigit() else 0


def declared_lives(mark: str) -> dict[int, int] | None:
    """The lives a lost mark declared dead (rank -> incarnation); None if it names none
    (a mark of an earlier version: every worker of the node)."""
    _, sep, lives = mark.partition("/")
    return parse_lives(lives) if sep else None


def format_lives(lives: dict[int, int]) -> str:
    return ",".join(f"{r}:{i}" for r, i in sorted(lives.items()))


def parse_lives(raw: bytes | str) -> dict[int, int]:
    """``rank:incarnation,...`` -> {rank: incarnation}; malformed parts are skipped."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    out: dict[int, int] = {}
    for part in text.split(","):
        r, _, i = part.partition(":")
        if r.strip().isdigit() and i.strip().isdigit():
            out[int(r)] = int(i)
    return out


def mark_lost(
    store: Any, keys: JobKeys, node: int, by: int, counter: int
) -> tuple[dict[int, int], str] | None:
    """Mark ``node`` lost in ``store`` (compare-and-set; ``by``: the declaring node,
    ``counter``: the lease value that stopped): the lives the mark declares dead and the
    mark; None if another agent declared it (or the node is done). The store's errors
    are the caller's."""
    # (read first: the mark names the lives it declares dead, so that the node's fence,
    # seen after its link returns, kills those and never a newer life)
    lives = parse_lives(store.get(keys.node_lives(node)))
    mark = lost_mark(counter, by, lives)
    return (lives, mark) if put_mark(store, keys, node, mark) else None


def put_mark(store: Any, keys: JobKeys, node: int, mark: str) -> bool:
    """Write ``node``'s lost mark unless it has one (compare-and-set); whether this one is
    there now. The store's errors are the caller's."""
    key = keys.node_lost(node)
    try:
        got = bytes(store.compare_set(key, "", mark)).decode()
    except ForgedValue as f:  # a mark without the job's secret is none
        got = bytes(store.replace(key, f.raw, mark)).decode()
    return got == mark
