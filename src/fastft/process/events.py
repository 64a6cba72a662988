"""The job's event log: one JSON object per line in ``RUN_DIR/events.jsonl``.

Every process of the job (agents and workers) appends to the same file with ``O_APPEND``
and one ``write()`` per line, so lines never interleave. Each line carries ``t`` (wall
time, seconds), ``mono`` (CLOCK_MONOTONIC, comparable across the processes of one
machine), ``src`` (``agent`` or ``rank R``), ``event`` and event-specific fields.
``fastft report RUN_DIR`` reads it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "EVENTS_FILE", "read_events"]

EVENTS_FILE = "events.jsonl"
log = logging.getLogger(__name__)


class EventLog:
    """Appends events; a no-op when ``run_dir`` is None. Thread-safe."""

    def __init__(self, run_dir: str | os.PathLike[str] | None, src: str) -> None:
        self.src = src
        self._fd: int | None = None
        self._lock = threading.Lock()
        if run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._fd = os.open(
                Path(run_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
            )

    def emit(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        rec = {"t": time.time(), "mono": time.monotonic(), "src": self.src, "event": event}
        rec.update(fields)
        line = (json.dumps(rec, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                return
            try:
                os.write(self._fd, line)
            except OSError:
                log.warning("event log: cannot write %s", event, exc_info=True)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, in the order of their monotonic time; unreadable lines are
    skipped with a warning (a process killed mid-write leaves at most one)."""
    path = Path(run_dir) / EVENTS_FILE
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: not JSON, skipped", path, n)
                continue
            if isinstance(rec, dict) and "event" in rec:
                out.append(rec)
    out.sort(key=lambda r: r.get("mono", 0.0))
    return out
