"""The run's commits, as S5 checks them when the world shrinks: which slice of each step's
global batch each member committed, and whether they tile it exactly once."""

from __future__ import annotations

from typing import Any

__all__ = ["shards_by_step", "unlogged_commits", "untiled_steps"]


def shards_by_step(events: list[dict[str, Any]]) -> dict[int, list[tuple[int, int, int]]]:
    """The ``(lo, hi, n)`` slices of the global batch each member committed, per step
    (from ``tx.shard``, with the range of a kept gradient a member added; steps without
    shards are absent)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for e in events:
        if e["event"] == "commit" and e.get("shard"):
            for key in ("shard", "kept"):
                if e.get(key):
                    lo, hi, n = e[key]
                    out.setdefault(e["step"], []).append((lo, hi, n))
    for parts in out.values():
        parts.sort()
    return out


def unlogged_commits(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The commits a member made but never logged: it voted to commit a step and died
    before its commit event (a commit needs every member's vote, so its gradient was in the
    step). One per step its epoch's other members committed after its last logged commit,
    at most one: the step after it, with the shard it had there (to be added to the
    events for :func:`shards_by_step`). A member missing from a step that was alive is no
    such case, and stays missing."""
    died: set[int] = set()
    for e in events:
        fault1 = e["event"] == "peer_fault" and e.get("severity") == "FAULT1"
        if (e["event"] == "worker_exit" or fault1) and e.get("incarnation") is not None:
            died.add(e["incarnation"])
    members: dict[int, dict[str, int]] = {}  # epoch -> src -> incarnation
    commits: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}  # (epoch, step) -> src
    for e in events:
        if e["event"] == "epoch" and e.get("incarnations"):
            members[e["epoch"]] = {
                f"rank {r}": i for r, i in zip(e["members"], e["incarnations"], strict=False)
            }
        elif e["event"] == "commit":
            commits.setdefault((e["epoch"], e["step"]), {})[e["src"]] = e
    out = []
    for (epoch, step), by in sorted(commits.items()):
        for src, inc in members.get(epoch, {}).items():
            before = commits.get((epoch, step - 1), {}).get(src)
            if src in by or inc not in died or before is None or before.get("kept"):
                continue
            if any(s > step for (ep, s), b in commits.items() if ep == epoch and src in b):
                continue  # (it logged a later commit: not a death after this one)
            out.append({**before, "step": step, "digest": None, "unlogged": True})
    return out


def untiled_steps(shards: dict[int, list[tuple[int, int, int]]]) -> list[int]:
    """Committed steps whose shards do not cover their global batch exactly once (S5 when
    the world shrinks: every sample of every committed step consumed once)."""
    bad = []
    for step, parts in sorted(shards.items()):
        n = parts[0][2]
        ends = [p[0] for p in parts[1:]] == [p[1] for p in parts[:-1]]
        if parts[0][0] != 0 or parts[-1][1] != n or not ends or {p[2] for p in parts} != {n}:
            bad.append(step)
    return bad
