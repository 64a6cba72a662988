"""A lost node's mark and the worker lives it names (:mod:`fastft.launch.lease`): the
lease value that stopped, the node that saw it stop, and ``rank:incarnation`` pairs."""

from __future__ import annotations

__all__ = ["declared_lives", "format_lives", "lost_mark", "parse_lives"]


def lost_mark(counter: int, by: int, lives: dict[int, int]) -> str:
    """A node's lost mark: the lease value that stopped, the node that saw it stop, and the
    worker lives it declared dead, which are the only ones the node's fence kills."""
    return f"{counter}@{by}/{format_lives(lives)}"


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
