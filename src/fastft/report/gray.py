"""Gray failures in a run's report: the members named stragglers
(:mod:`fastft.launch.stragglers`) and what was done about them."""

from __future__ import annotations

from typing import Any

__all__ = ["gray_lines", "stragglers"]


def stragglers(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each life the agents named a straggler, in order: its rank, how much slower it
    computed than the others, the step the job was at and what was done."""
    commits = sorted((e["mono"], e["step"]) for e in ev if e["event"] == "commit")
    out = []
    for e in ev:
        if e["event"] != "straggler":
            continue
        step = max((s for t, s in commits if t <= e["mono"]), default=None)
        out.append(
            {
                "rank": e["rank"],
                "ratio": e["ratio"],
                "compute_ms": e["compute_ms"],
                "others_ms": e["others_ms"],
                "step": step,
                "action": e["action"],
                "t": e["mono"],
            }
        )
    return out


def gray_lines(s: dict[str, Any]) -> list[str]:
    """The report's lines for the stragglers of summary ``s``."""
    if not s.get("stragglers"):
        return []
    lines = ["", "stragglers (members every step waited for):"]
    for x in s["stragglers"]:
        done = "drained and replaced" if x["action"] == "replace" else "reported"
        lines.append(
            f"  rank {x['rank']} at step {x['step'] if x['step'] is not None else '-'}: "
            f"{x['ratio']:.2f}x the others' compute ({x['compute_ms']:.0f} ms against "
            f"{x['others_ms']:.0f} ms a step); {done}"
        )
    return lines
