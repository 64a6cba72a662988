"""The run's commits, as S5 checks them when the world shrinks: which slice of each step's
global batch each member committed, and whether they tile it exactly once."""

from __future__ import annotations

from typing import Any

from fastft.protocol.shards import plan, tile

__all__ = ["member_shard", "shards_by_step", "unlogged_commits", "untiled_steps"]


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
    at most one: the step after it, with the shard the member had there, computed as the
    runtime computes it (:func:`member_shard`), to be added to the events for
    :func:`shards_by_step`. A member missing from a step that was alive is no such case,
    and stays missing."""
    died: set[int] = set()
    for e in events:
        fault1 = e["event"] == "peer_fault" and e.get("severity") == "FAULT1"
        if (e["event"] == "worker_exit" or fault1) and e.get("incarnation") is not None:
            died.add(e["incarnation"])
    epochs: dict[int, dict[str, Any]] = {}
    adopted: dict[tuple[int, str], dict[str, Any]] = {}  # (epoch, src) -> its epoch event
    commits: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}  # (epoch, step) -> src
    for e in events:
        if e["event"] == "epoch" and e.get("incarnations"):
            epochs[e["epoch"]] = e
            adopted[(e["epoch"], e.get("src", ""))] = e
        elif e["event"] == "commit":
            commits.setdefault((e["epoch"], e["step"]), {})[e["src"]] = e
    out = []
    for (epoch, step), by in sorted(commits.items()):
        view = epochs.get(epoch)
        if view is None:
            continue
        ranks = list(view["members"])
        for rank, inc in zip(ranks, view["incarnations"], strict=False):
            src = f"rank {rank}"
            before = commits.get((epoch, step - 1), {}).get(src)
            if before is None and step == view.get("step"):  # the epoch's first step: its
                before = adopted.get((epoch, src))  # adoption stands for the commit before
            if src in by or inc not in died or before is None:
                continue
            if any(s > step for (ep, s), b in commits.items() if ep == epoch and src in b):
                continue  # (it logged a later commit: not a death after this one)
            n = next((c["shard"][2] for c in by.values() if c.get("shard")), None)
            parts = member_shard(view, step, n, ranks.index(rank)) if n else {}
            out.append(
                {**before, "event": "commit", "step": step, "digest": None, "unlogged": True}
                | {"epoch": epoch, **parts}
            )
    return out


def member_shard(view: dict[str, Any], step: int, n: int, index: int) -> dict[str, Any]:
    """The ``shard`` (and ``kept``) member ``index`` of the epoch logged as ``view`` had in
    ``step`` of a batch of ``n``, as ``Kept.shard`` computes it: the epoch's first step
    leaves the kept parts it was offered with their holders, every other step is a plain
    tile."""
    world = len(view["members"])
    offered = {
        view["members"].index(r): (lo, hi, m)
        for r, lo, hi, m in view.get("kept") or ()
        if r in view["members"]
    }
    if view.get("step") == step and offered:
        p = plan(n, world, offered)
        lo, hi = p.pieces[index]
        kept = p.kept.get(index)
        return {"shard": [lo, hi, n], "kept": [*kept, n] if kept else None}
    lo, hi = tile(0, n, world, index)
    return {"shard": [lo, hi, n], "kept": None}


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
