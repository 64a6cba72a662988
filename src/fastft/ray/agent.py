"""A node agent as a Ray actor: ``fastft run`` for one node, unchanged, as the actor's
child process; or its standby (``fastft run --standby``: warm, waiting to take the node
over when the driver calls :meth:`NodeAgent.go`).

The agent keeps doing what it does on a node started by hand: its workers, warm spares
and zygote are its own children, so a worker's death is seen by the exit trace in under
a millisecond and a hang by the heartbeat, not by Ray. The actor only starts it (in its
constructor: a restarted actor starts a new agent, which is a node started again: its
workers join and heal), holds its output for the driver, and stops it. The agent dies
with the actor (``PR_SET_PDEATHSIG``), and its workers with the agent.

No Ray import here: the driver wraps the class with ``ray.remote``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from fastft.launch.procs.children import die_with_parent
from fastft.process.events import EVENTS_FILE

__all__ = ["NodeAgent", "file_identity"]

MAX_LINES = 2000
"""Output lines one poll returns at most."""
EVENTS_CHUNK = 8 << 20
"""Bytes of a node's events file one call returns at most."""


def file_identity(path: Path) -> tuple[str, int, int]:
    """(host, device, inode) of ``path``: the same file whoever asks on that machine."""
    st = path.stat()
    return (socket.gethostname(), st.st_dev, st.st_ino)


def _write(path: Path, data: bytes) -> None:
    """``data`` at ``path`` (owner-only), unless the file already holds it (one machine,
    several agents)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class NodeAgent:
    """``fastft run ARGV`` on this actor's node (see the module)."""

    def __init__(
        self,
        node: int,
        argv: list[str],
        secret: bytes,
        secret_path: str,
        run_dir: str,
        files: dict[str, bytes] | None = None,
        standby: bool = False,
    ) -> None:
        self.node = node
        self.standby = standby
        self.run_dir = run_dir
        # (every node reads one secret file; ``files``: what the job needs on every
        # machine, a Trainer's pickled training function)
        for where, data in {secret_path: secret, **(files or {})}.items():
            _write(Path(where), data)
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastft.cli", "run", *(["--standby"] if standby else []), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
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

    def go(self, env: dict[str, str] | None = None) -> bool:
        """A standby: take the node over now (its agent died), with ``env`` set in the
        agent (the dead agent's ``CUDA_VISIBLE_DEVICES``: a standby holds no GPU of
        Ray's); False if this is no standby waiting (not one, told already, or its
        process ended)."""
        if not self.standby or self.proc.stdin is None or self.proc.poll() is not None:
            return False
        try:
            self.proc.stdin.write(json.dumps(env or {}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return False
        self.standby = False
        return True

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
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),  # (Ray's, for this actor)
        }

    def events(self, offset: int) -> dict[str, Any]:
        """This node's events file from byte ``offset`` (at most ``EVENTS_CHUNK`` bytes),
        with what names the file (host, device, inode) so the driver can tell its own."""
        path = Path(self.run_dir) / EVENTS_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            return {"where": None, "data": b"", "size": 0}
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(EVENTS_CHUNK)
        return {"where": file_identity(path), "data": data, "size": st.st_size}

    def stop(self, grace_s: float = 30.0) -> int | None:
        """End the agent as a SIGTERM ends ``fastft run`` (its workers drain), then kill it
        after ``grace_s``; its exit status (a standby not told to go: its stdin closed,
        it exits 0)."""
        if self.standby and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        return self.proc.returncode
