"""Where a run's files go when nobody says: ``./runs/`` under the working directory."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

__all__ = ["default_run_dir"]


def default_run_dir(job: str, name: str = "") -> Path:
    """``./runs/JOB-YYYYmmdd-HHMMSS-PID`` under the working directory (where a user looks
    for it, and removes it), or a temporary directory where that cannot be written."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path.cwd() / "runs" / f"{name or job}-{stamp}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return Path(tempfile.mkdtemp(prefix="fastft-run-"))
    return path
