"""How a worker's life ended, read from its ``worker_exit`` event."""

from __future__ import annotations

from typing import Any

from fastft.protocol.exits import ENDS_THE_JOB, EXIT_DRAINED

__all__ = ["no_fault"]

_JOB_ENDING = (EXIT_DRAINED, *ENDS_THE_JOB)
"""Worker exit statuses that are no fault of their own: a drain, or the job that cannot go
on (:mod:`fastft.protocol.exits`); the report shows those as the job's outcome."""


def no_fault(e: dict[str, Any]) -> bool:
    """Whether the exit of ``e`` (a ``worker_exit`` event) was no fault of the worker's: a
    clean end, or a status of :data:`_JOB_ENDING` that fastft recorded (its ``ending``; an
    event log older than the record has none, and its statuses count as fastft's)."""
    code = e.get("exit_code")
    return code == 0 or (code in _JOB_ENDING and e.get("ending", "") is not None)
