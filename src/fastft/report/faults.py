"""A run's faults, from its event log: each fault once (an injection, then the exception,
exit, stop or hang it caused), and its figures: when the survivors heard of it, when they
committed again, when a restarted worker did (:func:`fastft.report.summarize`)."""

from __future__ import annotations

from typing import Any

from fastft.report.outcome import no_fault

__all__ = ["ENDS", "PROCESS_EVENTS", "fault_list", "rank_of", "time_fault"]

PROCESS_EVENTS = ("worker_exit", "worker_stopped", "worker_hung")
FAULT_EVENTS = (
    "injected",
    "reported_fault",
    "kill_declared_dead",
    "local_fault",
    *PROCESS_EVENTS,
)
ENDS = ("stop", "job_failed")
"""The agent stops the job (Ctrl-C, a second SIGTERM) or fails it: its kills are no faults."""


def rank_of(src: str) -> int | None:
    """The worker rank of an event's source: ``rank N`` (native runtime) or ``replica N``
    (ManagerFFT, one replica group per worker)."""
    kind, _, n = src.partition(" ")
    return int(n) if kind in ("rank", "replica") and n.isdigit() else None


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


def fault_list(ev: list[dict[str, Any]], commits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's faults, one per fault: an injection, then the local exception, exit, stop
    or hang it caused, counted once (and a node lost, one for its ranks)."""
    faults: list[dict[str, Any]] = []
    stop = min((e["mono"] for e in ev if e["event"] in ENDS), default=float("inf"))
    for e in ev:
        name = e["event"]
        if name == "node_lost":
            _node_lost(faults, e, ev)
            continue
        if name == "worker_exit" and no_fault(e):
            continue  # a clean end, a drain, the job ending
        if name in PROCESS_EVENTS and (e["mono"] >= stop or e.get("signal") == 2):
            continue  # the job was stopped (Ctrl-C, a second SIGTERM): not a fault
        if name not in FAULT_EVENTS or (name == "injected" and e.get("kind") == "slow"):
            continue  # (a straggler is no fault of a step: its own section)
        rank = e.get("rank", rank_of(e["src"]))
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
                    and (name in PROCESS_EVENTS or t - f["t"] < 1.0)
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
    return faults


def time_fault(f: dict[str, Any], ev: list[dict[str, Any]]) -> None:
    """Fault ``f``'s figures: when the survivors heard of it, when they committed again,
    when a restarted worker did, and whether every holder of the state was lost."""
    t, r = f["t"], f["rank"]
    ranks = f.get("ranks") or [r]  # (a node lost: each of its ranks)
    others = [e for e in ev if e["mono"] >= t and rank_of(e["src"]) not in (None, *ranks)]
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
        (e["src"], e["epoch"], e["step"]) for e in ev if e["event"] == "rollback" and e["mono"] >= t
    }
    nxt = next((e for e in others if e["event"] == "commit" and _after(e, f, retried)), None)
    # (a lost node's workers start again as new lives: on its return, or a new agent's)
    restarted = any(s in f["seen_as"] for s in (*PROCESS_EVENTS, "node_lost"))
    if nxt is None and not restarted:  # a one-worker job: the faulty worker goes on itself
        nxt = next(
            (
                e
                for e in ev
                if e["mono"] >= t
                and e["event"] == "commit"
                and rank_of(e["src"]) == r
                and _after(e, f, retried)
            ),
            None,
        )
    back = (
        next(
            (
                e
                for e in ev
                if e["mono"] > t and e["event"] == "commit" and rank_of(e["src"]) in ranks
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
    if e["event"] in PROCESS_EVENTS:
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
