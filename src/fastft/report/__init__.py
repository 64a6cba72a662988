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


_PROCESS_EVENTS = ("worker_exit", "worker_stopped", "worker_hung")
_FAULT_EVENTS = (
    "injected",
    "reported_fault",
    "kill_declared_dead",
    "local_fault",
    *_PROCESS_EVENTS,
)
_ENDS = ("stop", "job_failed")
"""The agent stops the job (Ctrl-C, a second SIGTERM) or fails it: its kills are no faults."""


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


def _after(commit: dict[str, Any], fault: dict[str, Any], retried: set[Any]) -> bool:
    """Whether ``commit`` is of a step decided after ``fault``: in a later epoch, a later
    step, or the step rolled back after the fault and retried in its epoch."""
    if (
        commit["epoch"] > fault["epoch"]
        or (commit["src"], commit["epoch"], commit["step"]) in retried
    ):
        return True
    return fault["step"] is not None and commit["step"] > fault["step"]


def _ms(e: dict[str, Any] | None, t: float) -> float | None:
    return None if e is None else round((e["mono"] - t) * 1e3, 2)


def _rank_of(src: str) -> int | None:
    """The worker rank of an event's source: ``rank N`` (native runtime) or ``replica N``
    (ManagerFFT, one replica group per worker)."""
    kind, _, n = src.partition(" ")
    return int(n) if kind in ("rank", "replica") and n.isdigit() else None


def summarize(run_dir: str | Path, run: int = -1) -> dict[str, Any]:
    """The figures of run ``run`` of the directory (-1: the last; :func:`runs`)."""
    every = runs(read_events(run_dir))
    ev = every[run]
    commits = [e for e in ev if e["event"] == "commit"]
    faults: list[dict[str, Any]] = []
    stop = min((e["mono"] for e in ev if e["event"] in _ENDS), default=float("inf"))
    for e in ev:
        name = e["event"]
        if name == "node_lost":
            _node_lost(faults, e, ev)
            continue
        if name == "worker_exit" and no_fault(e):
            continue  # a clean end, a drain, the job ending
        if name in _PROCESS_EVENTS and (e["mono"] >= stop or e.get("signal") == 2):
            continue  # the job was stopped (Ctrl-C, a second SIGTERM): not a fault
        if name not in _FAULT_EVENTS or (name == "injected" and e.get("kind") == "slow"):
            continue  # (a straggler is no fault of a step: its own section)
        rank = e.get("rank", _rank_of(e["src"]))
        inc = e.get("incarnation")
        t = e["mono"]
        recent = [f for f in faults if t - f["t"] < 1.0]
        # one fault: an injection, then the local exception / exit / stop / hang it caused
        # (same life of the same worker; a hang is seen after the hang timeout only)
        same = None  # each injection is a fault of its own
        if name != "injected":
            same = next(
                (
                    f
                    for f in reversed(faults)
                    if f["rank"] == rank
                    and f["incarnation"] == inc
                    and (name in _PROCESS_EVENTS or t - f["t"] < 1.0)
                ),
                None,
            )
        if same is not None:
            same["seen_as"].append(name)
            continue
        # a survivor's collective failing on the dead peer's reset connection
        if name == "local_fault" and recent and "CollectiveFailed" in e.get("cause", ""):
            recent[-1]["secondary"] += 1
            continue
        faults.append(
            {
                "rank": rank,
                "incarnation": inc,
                "t": t,
                "kind": e.get(
                    "kind",
                    "reported" if name in ("reported_fault", "kill_declared_dead") else name,
                ),
                "cause": _cause(e, ev),
                "seen_as": [name],
                "step": e["step"] if e.get("step") is not None else _step_at(commits, t),
                "epoch": max(
                    (
                        x["epoch"]
                        for x in ev
                        if x["event"] in ("epoch", "commit") and x["mono"] <= t
                    ),
                    default=0,
                ),
                "secondary": 0,
            }
        )
    for f in faults:
        t, r = f["t"], f["rank"]
        ranks = f.get("ranks") or [r]  # (a node lost: each of its ranks)
        others = [e for e in ev if e["mono"] >= t and _rank_of(e["src"]) not in (None, *ranks)]
        intr = next((e for e in others if e["event"] in ("interrupt", "peer_fault")), None)
        if f["kind"] == "reported":  # the peers read the report as the agent did: maybe first
            heard = [
                e
                for e in ev
                if e["event"] == "peer_fault" and e.get("rank") == r and abs(e["mono"] - t) < 1.0
            ]
            if heard and (intr is None or heard[0]["mono"] < intr["mono"]):
                intr = {**heard[0], "mono": max(heard[0]["mono"], t)}
        # the survivors' first commit decided after the fault: the interrupted step's in a
        # later epoch, or a later step's. A step committed in the fault's own epoch was
        # decided before it (a kill at the commit point: the others commit what they voted)
        retried = {
            (e["src"], e["epoch"], e["step"])
            for e in ev
            if e["event"] == "rollback" and e["mono"] >= t
        }
        nxt = next((e for e in others if e["event"] == "commit" and _after(e, f, retried)), None)
        # (a lost node's workers start again as new lives: on its return, or a new agent's)
        restarted = any(s in f["seen_as"] for s in (*_PROCESS_EVENTS, "node_lost"))
        if nxt is None and not restarted:  # a one-worker job: the faulty worker goes on itself
            nxt = next(
                (
                    e
                    for e in ev
                    if e["mono"] >= t
                    and e["event"] == "commit"
                    and _rank_of(e["src"]) == r
                    and _after(e, f, retried)
                ),
                None,
            )
        back = (
            next(
                (
                    e
                    for e in ev
                    if e["mono"] > t and e["event"] == "commit" and _rank_of(e["src"]) in ranks
                ),
                None,
            )
            if restarted
            else None
        )
        lost = next(  # every holder gone: no survivor committed, the job restored or failed
            (
                e
                for e in ev
                if e["event"] == "epoch"
                and "lost" in e
                and e["mono"] >= t
                and (nxt is None or e["mono"] <= nxt["mono"])
            ),
            None,
        )
        f["total_loss"] = lost is not None
        if lost is not None:
            nxt = None
        f["detect_ms"] = _ms(intr, t)
        f["recover_ms"] = _ms(nxt, t)
        f["rejoin_ms"] = _ms(back, t)
        f["recovered"] = nxt is not None
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
        if (r := _rank_of(e["src"])) is not None:
            got["ranks"].append(r)
    return list(out.values())


def _step_at(commits: list[dict[str, Any]], t: float) -> int | None:
    """The step the job was running at ``t``: one past the last commit before it."""
    done = [e["step"] for e in commits if e["mono"] <= t]
    return max(done) + 1 if done else None


def _cause(e: dict[str, Any], ev: list[dict[str, Any]]) -> str | None:
    """What a fault's first event says caused it: its own cause, or for an exit the agent
    caused on a peer's or a monitor's word, that word."""
    if e.get("cause"):
        cause = str(e["cause"])
        if e["event"] == "reported_fault" and cause.startswith("reported by "):
            cause = cause.partition(": ")[2]  # (the kind says "reported" already)
        return cause[:120]
    if e["event"] in _PROCESS_EVENTS:
        said = [
            x
            for x in ev
            if x["event"] == "kill_declared_dead"
            and x.get("rank") == e.get("rank")
            and 0 <= e["mono"] - x["mono"] < 5.0
        ]
        if said:
            return f"declared dead: {said[-1].get('cause', '')}"[:120]
    return None


def _node_lost(faults: list[dict[str, Any]], e: dict[str, Any], ev: list[dict[str, Any]]) -> None:
    """A node lost whole: one fault of its ranks. A survivor's collective that failed on it
    first (before the lease ran out) is that fault, not a fault of the survivor."""
    lost = list(e.get("ranks", []))
    window = e.get("lease_ms", 0) / 1e3 + 1.0
    row = {
        "rank": f"node {e.get('node')}" + (f" (ranks {','.join(map(str, lost))})" if lost else ""),
        "ranks": lost,
        "incarnation": None,
        "t": e["mono"],
        "kind": "node_lost",
        "cause": f"its lease was not renewed for {e.get('lease_ms')} ms",
        "seen_as": ["node_lost"],
        "step": None,
        "epoch": max(
            (x["epoch"] for x in ev if x["event"] == "epoch" and x["mono"] <= e["mono"]),
            default=0,
        ),
        "secondary": 0,
    }
    for i, f in enumerate(faults):
        early = 0 <= e["mono"] - f["t"] <= window and f["kind"] == "local_fault"
        if early and f["rank"] not in lost:
            row.update(t=f["t"], step=f["step"], secondary=f["secondary"] + 1)
            faults[i] = row
            return
    if any(f["kind"] == "node_lost" and f["rank"] == row["rank"] for f in faults):
        return  # (every surviving node's agent declares it)
    faults.append(row)


def offenders(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker slots that faulted more than once (crashes, hangs, in-process restarts,
    failed health checks; not drains or clean ends), most first, and whether the agent
    quarantined them (``--quarantine``, :mod:`fastft.launch.rules.offenders`) and why."""
    count: dict[int, list[str]] = {}
    lives: set[tuple[int, Any]] = set()  # (a stop, then its kill: one fault of one life)
    end = min((e["mono"] for e in ev if e["event"] in _ENDS), default=float("inf"))
    for e in ev:
        name, rank = e["event"], e.get("rank", _rank_of(e["src"]))
        if rank is None or (name in _PROCESS_EVENTS and e["mono"] >= end):
            continue  # (the agent's own kills as it stops or fails the job)
        if name in _PROCESS_EVENTS or name == "health_failed":
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
