"""``fastft report RUN_DIR``: the timeline and the figures of a run, from its event log.

Per fault: when it happened (the injection, the local exception, or the agent seeing the
exit/stop/hang), when the first survivor was interrupted (detection), when the survivors
next committed a step (recovery), and when a restarted worker committed again (rejoin).
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Any

from fastft.process.events import read_events
from fastft.report.faults import ENDS, PROCESS_EVENTS, fault_list, rank_of, time_fault
from fastft.report.gray import gray_lines, repairs, stragglers
from fastft.report.outcome import no_fault, outcome, outcome_line, total_losses
from fastft.report.shards import shards_by_step, unlogged_commits, untiled_steps

__all__ = [
    "render_report",
    "runs",
    "shards_by_step",
    "summarize",
    "unlogged_commits",
    "untiled_steps",
]


def runs(ev: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The runs in one run directory's events, oldest first: a run starts with node 0's
    ``agent_start`` (the same ``--run-dir`` used twice holds two)."""
    starts = [e["mono"] for e in ev if e["event"] == "agent_start" and e.get("node_rank", 0) == 0]
    if len(starts) < 2:
        return [ev]
    bounds = [*starts[1:], float("inf")]
    out: list[list[dict[str, Any]]] = [[e for e in ev if e["mono"] < bounds[0]]]
    out += [[e for e in ev if a <= e["mono"] < b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return out


def summarize(run_dir: str | Path, run: int = -1) -> dict[str, Any]:
    """The figures of run ``run`` of the directory (-1: the last; :func:`runs`)."""
    every = runs(read_events(run_dir))
    ev = every[run]
    commits = [e for e in ev if e["event"] == "commit"]
    faults = fault_list(ev, commits)
    for f in faults:
        time_fault(f, ev)
    steps = sorted({e["step"] for e in commits})
    rolled = {(e["epoch"], e["step"]) for e in ev if e["event"] == "rollback"}
    per_rank: dict[str, list[float]] = {}
    for e in commits:
        per_rank.setdefault(e["src"], []).append(e["mono"])
    gaps = [b - a for ts in per_rank.values() for a, b in zip(ts, ts[1:], strict=False)]
    step_s = statistics.median(gaps) if gaps else 0.0
    span = (max(e["mono"] for e in commits) - min(e["mono"] for e in commits)) if commits else 0
    goodput = min(1.0, len(steps) * step_s / span) if span > 0 else None
    return {
        "run_dir": str(run_dir),
        "run": len(every) + run + 1 if run < 0 else run + 1,
        "runs": len(every),
        "total_losses": total_losses(ev),
        "offenders": offenders(ev),
        "stragglers": stragglers(ev),
        "repairs": repairs(ev),
        "stopped": stops(ev),
        "outcome": outcome(ev, steps[-1] + 1 if steps else 0),
        "steps_committed": len(steps),
        "last_step": steps[-1] if steps else None,
        "steps_rolled_back": len(rolled),
        # epochs of the native runtime, or torchft quorums under ManagerFFT
        "epochs": len({e["epoch"] for e in ev if e["event"] == "epoch"})
        + len({e["quorum"] for e in ev if e["event"] == "quorum"}),
        "heals": sum(1 for e in ev if e["event"] == "heal" and e.get("role") == "fetch")
        + sum(1 for e in ev if e["event"] == "quorum" and e.get("heal")),
        "restarts": sum(1 for e in ev if e["event"] == "restart"),
        "median_step_ms": round(step_s * 1e3, 3),
        "goodput": None if goodput is None else round(goodput, 3),
        "faults": faults,
        "checkpoints": {
            kind: sum(e["event"] == name for e in ev)
            for kind, name in (
                ("written", "checkpoint"),
                ("skipped", "checkpoint_skipped"),
                ("failed", "checkpoint_failed"),
            )
        },
    }


_STOPS = {
    "replicas_diverged": "the replicas diverged",
    "data_diverged": "the members drew different batches",
    "script_error": "the script cannot work under fastft",
}


def stops(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Why the job stopped on purpose (the in-band replica check, the batch check, a
    script's misuse): each reason once, with the ranks that reported it and, for the
    replica check, what differed and on which members."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for e in ev:
        if e["event"] not in _STOPS or e.get("action", "stop") != "stop":
            continue  # (a replica repaired: report.gray)
        key = (e["event"], e.get("repair") or e.get("error", ""))
        got = out.setdefault(
            key,
            {
                "what": _STOPS[e["event"]],
                "step": e.get("step"),
                "items": e.get("items"),
                "minority": e.get("minority"),
                "error": e.get("repair") or e.get("error", ""),
                "ranks": [],
            },
        )
        if (r := rank_of(e["src"])) is not None:
            got["ranks"].append(r)
    return list(out.values())


def offenders(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker slots that faulted more than once (crashes, hangs, in-process restarts,
    failed health checks; not drains or clean ends), most first, and whether the agent
    quarantined them (``--quarantine``, :mod:`fastft.launch.rules.offenders`) and why."""
    count: dict[int, list[str]] = {}
    lives: set[tuple[int, Any]] = set()  # (a stop, then its kill: one fault of one life)
    end = min((e["mono"] for e in ev if e["event"] in ENDS), default=float("inf"))
    for e in ev:
        name, rank = e["event"], e.get("rank", rank_of(e["src"]))
        if rank is None or (name in PROCESS_EVENTS and e["mono"] >= end):
            continue  # (the agent's own kills as it stops or fails the job)
        if name in PROCESS_EVENTS or name == "health_failed":
            life = (rank, e.get("incarnation"))
            if life[1] is not None and life in lives:
                continue
            lives.add(life)
        if name == "worker_exit" and not no_fault(e):
            what = f"exit {e['exit_code']}" if e.get("signal") is None else f"signal {e['signal']}"
        elif name in ("worker_hung", "worker_stopped", "health_failed"):
            what = name.removeprefix("worker_")
        elif name == "restarted_in_process":
            what = "in-process restart"
        else:
            continue
        count.setdefault(rank, []).append(what)
    why = {e["rank"]: e["reason"] for e in ev if e["event"] == "quarantined"}
    out = [
        {"rank": r, "faults": len(w), "kinds": sorted(set(w)), "quarantined": why.get(r)}
        for r, w in count.items()
        if len(w) > 1 or r in why
    ]
    return sorted(out, key=lambda o: (-o["faults"], o["rank"]))


def render_report(run_dir: str | Path, s: dict[str, Any]) -> str:
    lines = [f"Report of the run in {run_dir}"]
    if s.get("runs", 1) > 1:
        lines.append(
            f"run {s['run']} of the {s['runs']} in this directory (--run-dir used again; "
            "fastft report --run N for another)"
        )
    if s.get("outcome"):
        lines.append(outcome_line(s["outcome"]))
    lines.append("")
    lines.append(
        "| # | rank | fault | step | detected (ms) | survivors' next commit (ms) "
        "| restarted worker committing (ms) |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for i, f in enumerate(s["faults"], 1):

        def fmt(v: Any) -> str:
            return "-" if v is None else f"{v:.1f}"

        recover = "- (no survivor)" if f.get("total_loss") else fmt(f["recover_ms"])
        cause = textwrap.shorten(f.get("cause") or "", 72, placeholder=" ...")  # (whole words)
        lines.append(
            f"| {i} | {f['rank']} | {f['kind']}{': ' + cause if cause else ''}"
            + (f" (+{f['secondary']} peer collectives failed)" if f["secondary"] else "")
            + f" | {f['step'] if f['step'] is not None else '-'} "
            f"| {fmt(f['detect_ms'])} | {recover} | {fmt(f['rejoin_ms'])} |"
        )
    for x in s["total_losses"]:
        lines.append("")
        what = (
            "the job failed (no checkpoint)"
            if x["outcome"] == "job failed"
            else f"{x['outcome']} from step {x['restored']}: {x['redone']} steps trained again"
        )
        lines.append(
            f"total loss in epoch {x['epoch']}: no live member held the state of step "
            f"{x['committed']}; {what}"
        )
    if s["offenders"]:
        lines += ["", "repeat offenders (worker slots that faulted more than once):"]
        for o in s["offenders"]:
            q = f"; quarantined: {o['quarantined']}" if o["quarantined"] else ""
            lines.append(f"  rank {o['rank']}: {o['faults']} faults ({', '.join(o['kinds'])}){q}")
    lines += gray_lines(s)
    for x in s.get("stopped", []):
        lines += ["", f"the job stopped at step {x['step']}: {x['what']}"]
        if x.get("items"):
            lines.append(f"  differs: {', '.join(x['items'])} on ranks {x['minority']}")
        lines.append(f"  {x['error']}")
    ck = s.get("checkpoints") or {}
    if any(ck.values()):
        lines += [
            "",
            f"checkpoints: {ck['written']} written, {ck['skipped']} skipped (the previous "
            f"write still running), {ck['failed']} failed",
        ]
    lines.append("")
    lines.append(
        f"steps committed {s['steps_committed']}, rolled back {s['steps_rolled_back']}, "
        f"epochs {s['epochs']}, heals {s['heals']}, restarts {s['restarts']}, "
        f"median step {s['median_step_ms']} ms, goodput {s['goodput']}"
    )
    return "\n".join(lines)
