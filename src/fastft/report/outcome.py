"""How a worker's life ended, read from its ``worker_exit`` event."""

from __future__ import annotations

from typing import Any

from fastft.protocol.exits import ENDS_THE_JOB, EXIT_DRAINED

__all__ = ["no_fault", "outcome", "outcome_line", "total_losses", "unfired"]

_JOB_ENDING = (EXIT_DRAINED, *ENDS_THE_JOB)
"""Worker exit statuses that are no fault of their own: a drain, or the job that cannot go
on (:mod:`fastft.protocol.exits`); the report shows those as the job's outcome."""


def no_fault(e: dict[str, Any]) -> bool:
    """Whether the exit of ``e`` (a ``worker_exit`` event) was no fault of the worker's: a
    clean end, or a status of :data:`_JOB_ENDING` that fastft recorded (its ``ending``; an
    event log older than the record has none, and its statuses count as fastft's)."""
    code = e.get("exit_code")
    return code == 0 or (code in _JOB_ENDING and e.get("ending", "") is not None)


def outcome(ev: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """How one run ended, from its agents' events: ``ended`` is ``finished``, ``failed``
    (``why``: the agent's reason), ``preempted`` (a SIGTERM: the workers drained; the same
    command resumes with a checkpoint directory), ``interrupted`` (Ctrl-C), ``stopped`` (a
    second SIGTERM, the grace run out) or ``running`` (no agent stopped: still running, or
    its agent was killed); ``steps``: how many steps it committed."""
    failed = next((e.get("reason") for e in ev if e["event"] == "job_failed"), None)
    stop = next((e.get("signal") for e in ev if e["event"] == "stop"), None)
    drained = any(e["event"] == "drain" and e.get("why") == "SIGTERM" for e in ev)
    stopped = any(e["event"] == "agent_stop" for e in ev)
    if failed is not None:
        ended, why = "failed", str(failed)
    elif stop == 2:
        ended, why = "interrupted", "Ctrl-C"
    elif stop is not None:
        ended, why = "stopped", f"signal {stop} before the workers drained"
    elif drained and stopped:
        ended, why = "preempted", "SIGTERM: the workers drained"
    elif stopped:
        ended, why = "finished", None
    else:
        ended, why = "running", "no agent has stopped: still running, or its agent was killed"
    return {"ended": ended, "why": why, "steps": steps, "unfired": unfired(ev)}


def unfired(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The faults of the ``--inject`` plan (the agents' ``agent_start`` events carry it)
    that no worker fired, each with ``why`` when the events tell: the rank's planned life
    ended before the step (a fault fires in one life, 0 unless it says ``life``), or the
    job ended before it."""
    life_of = {
        (e["src"], e.get("incarnation")): e.get("life", 0)
        for e in ev
        if e["event"] == "worker_start"
    }
    lives: dict[str, int] = {}
    for (src, _), life in life_of.items():
        lives[src] = max(lives.get(src, 0), life)
    fired = [
        (e["src"], life_of.get((e["src"], e.get("incarnation"))), e.get("kind"), e.get("step"))
        for e in ev
        if e["event"] == "injected"
    ]
    top = max((e["step"] for e in ev if e["event"] == "commit"), default=-1)
    out = []
    for plan in (e.get("plan") or [] for e in ev if e["event"] == "agent_start"):
        for f in plan:
            src, at = f"rank {f['rank']}", f.get("at_step")
            want = (src, f.get("life", 0), f["kind"])
            # (a fault without at_step fires at once, at whatever step that is)
            if any(x[:3] == want and (at is None or x[3] == at) for x in fired):
                continue
            why = None
            if lives.get(src, 0) > f.get("life", 0):
                why = (
                    f"{src}'s life {f.get('life', 0)} ended before step {at}: a fault fires "
                    'in one life of its rank (0 unless it says "life")'
                )
            elif at is not None and top < at:
                why = f"the job ended before step {at}"
            out.append({**f, "why": why})
    return out


def unfired_line(f: dict[str, Any]) -> str:
    """One line for a planned fault that never fired."""
    at = "at once" if f.get("at_step") is None else f"at step {f['at_step']}"
    point = "" if f.get("point", "step") == "step" else f" ({f['point']})"
    why = f": {f['why']}" if f.get("why") else ""
    return f"planned fault never fired: {f['kind']} on rank {f['rank']} {at}{point}{why}"


def outcome_line(o: dict[str, Any]) -> str:
    """The report's first line about how the job ended."""
    verb = _VERBS.get(o["ended"], o["ended"])
    why = f": {o['why']}" if o.get("why") else ""
    first = f"the job {verb} after {o['steps']} steps committed{why}"
    return "\n".join([first, *(unfired_line(f) for f in o.get("unfired", []))])


_VERBS = {
    "preempted": "was preempted",
    "interrupted": "was interrupted",
    "stopped": "was stopped",
    "running": "has not ended",
}


def total_losses(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each epoch that closed without a live holder of the committed state: the state the
    job had committed (``committed``: the step it was at), and what became of it (restored
    from the checkpoint of ``restored``, so steps ``restored..committed - 1`` were trained
    again; started again from 0; or the job failed)."""
    out = []
    for epoch in sorted({e["epoch"] for e in ev if e["event"] == "epoch" and "lost" in e}):
        first = min(
            (e for e in ev if e["event"] == "epoch" and e["epoch"] == epoch),
            key=lambda e: e["mono"],
        )
        before = [e["step"] for e in ev if e["event"] == "commit" and e["mono"] < first["mono"]]
        committed = max([first["lost"], *(s + 1 for s in before)])
        restored = first.get("restore")
        if restored is not None:
            outcome = "restored"
        elif any(e["event"] == "fresh_start" and e["epoch"] == epoch for e in ev):
            outcome, restored = "fresh start", 0
        else:
            outcome = "job failed"
        out.append(
            {
                "epoch": epoch,
                "committed": committed,
                "restored": restored,
                "outcome": outcome,
                "redone": None if restored is None else committed - restored,
            }
        )
    return out
