"""How a worker's life ended, read from its ``worker_exit`` event."""

from __future__ import annotations

from typing import Any

from fastft.protocol.exits import ENDS_THE_JOB, EXIT_DRAINED

__all__ = ["no_fault", "outcome", "outcome_line"]

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
    return {"ended": ended, "why": why, "steps": steps}


def outcome_line(o: dict[str, Any]) -> str:
    """The report's first line about how the job ended."""
    verb = _VERBS.get(o["ended"], o["ended"])
    why = f": {o['why']}" if o.get("why") else ""
    return f"the job {verb} after {o['steps']} steps committed{why}"


_VERBS = {
    "preempted": "was preempted",
    "interrupted": "was interrupted",
    "stopped": "was stopped",
    "running": "has not ended",
}
