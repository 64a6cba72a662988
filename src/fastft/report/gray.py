"""Gray failures in a run's report: the members named stragglers
(:mod:`fastft.launch.gray.stragglers`) and the nodes' links (:mod:`fastft.launch.gray.links`), the replicas found corrupted by the in-band replica
check and repaired (:func:`fastft.runtime.state.compare.repair`), and what was done."""

from __future__ import annotations

from typing import Any

__all__ = ["gray_lines", "repairs", "stragglers"]


def stragglers(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each life the agents named a straggler, in order: its rank, how much slower it
    computed than the others, the step the job was at and what was done."""
    commits = sorted((e["mono"], e["step"]) for e in ev if e["event"] == "commit")
    out = []
    for e in ev:
        if e["event"] not in ("straggler", "slow_link"):
            continue
        step = max((s for t, s in commits if t <= e["mono"]), default=None)
        if e["event"] == "slow_link":  # (a node's link, found by a probe: fastft.launch.gray.links)
            out.append(
                {
                    "node": e["node"],
                    "direction": e["direction"],
                    "ratio": e["ratio"],
                    "probe_ms": e["probe_ms"],
                    "others_ms": e["others_ms"],
                    "step": step,
                    "action": e["action"],
                    "t": e["mono"],
                }
            )
            continue
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


_REPAIRED = {
    "rewind": "every member went back to its last verified state and ran the steps again",
    "heal": "the minority healed from the majority",
    "retry": "no majority: the step ran again",
    "restore": "no majority, again: the durable tier restored the job",
}


def repairs(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mismatch of the replicas the job repaired (not the one that stopped it), once
    (every member reports it)."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in ev:
        if e["event"] == "replicas_diverged" and e.get("action") in _REPAIRED:
            key = (e.get("epoch"), e["step"], e["action"])
            out.setdefault(key, {k: e.get(k) for k in ("step", "items", "minority", "action")})
    return list(out.values())


def gray_lines(s: dict[str, Any]) -> list[str]:
    """The report's lines for the stragglers and the repaired replicas of summary ``s``."""
    lines = []
    if s.get("repairs"):
        lines += ["", "replicas repaired (the in-band replica check found them different):"]
        for x in s["repairs"]:
            who = ", ".join(map(str, x["minority"] or [])) or "-"
            where = f"on rank {who}" if x["action"] == "heal" else "between the members"
            what = ", ".join(x["items"] or [])
            lines.append(f"  step {x['step']}: {what} differed {where}; {_REPAIRED[x['action']]}")
    if not s.get("stragglers"):
        return lines
    lines += ["", "stragglers (members every step waited for):"]
    for x in s["stragglers"]:
        at = x["step"] if x["step"] is not None else "-"
        if "node" in x:
            done = "its workers drained, quarantined" if x["action"] == "replace" else "reported"
            lines.append(
                f"  node {x['node']}'s link at step {at}: {x['direction']} {x['ratio']:.1f}x "
                f"slower than the others' (a {x['probe_ms']:.0f} ms probe against "
                f"{x['others_ms']:.0f} ms); {done}"
            )
            continue
        done = "drained and replaced" if x["action"] == "replace" else "reported"
        lines.append(
            f"  rank {x['rank']} at step {x['step'] if x['step'] is not None else '-'}: "
            f"{x['ratio']:.2f}x the others' compute ({x['compute_ms']:.0f} ms against "
            f"{x['others_ms']:.0f} ms a step); {done}"
        )
    return lines
