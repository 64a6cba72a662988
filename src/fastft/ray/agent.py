"""A node agent as a Ray actor: ``fastft run`` for one node, unchanged, as the actor's
child process.

The agent keeps doing what it does on a node started by hand: its workers, warm spares
and zygote are its own children, so a worker's death is seen by the exit trace in under
a millisecond and a hang by the heartbeat, not by Ray. The actor only starts it (in its
constructor: a restarted actor starts a new agent, which is a node started again: its
workers join and heal), holds its output for the driver, and stops it. The agent dies
with the actor (``PR_SET_PDEATHSIG``), and its workers with the agent.

No Ray import here: the driver wraps the class with ``ray.remote``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from fastft.launch.children import die_with_parent

__all__ = ["NodeAgent"]

MAX_LINES = 2000
"""Output lines one poll returns at most."""


class NodeAgent:
    """``fastft run ARGV`` on this actor's node (see the module)."""

    def __init__(self, node: int, argv: list[str], secret: bytes, secret_path: str) -> None:
        self.node = node
        path = Path(secret_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != secret:  # (every node reads one file)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secret)
            os.replace(tmp, path)
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastft.cli", "run", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # (the actor's death is the node's)
        )
        self._reader = threading.Thread(target=self._read, name="fastft-ray-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._lock:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
        self.proc.wait()

    def poll(self, offset: int) -> dict[str, Any]:
        """The agent's output from line ``offset``, and its exit status once it ended and
        every line was read (None before); ``pid`` names this life of the actor."""
        with self._lock:
            lines = self.lines[offset : offset + MAX_LINES]
            more = offset + len(lines) < len(self.lines)
        done = not self._reader.is_alive() and not more
        return {
            "pid": os.getpid(),
            "agent_pid": self.proc.pid,
            "lines": lines,
            "rc": self.proc.returncode if done else None,
        }

    def stop(self, grace_s: float = 30.0) -> int | None:
        """End the agent as a SIGTERM ends ``fastft run`` (its workers drain), then kill it
        after ``grace_s``; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        return self.proc.returncode
