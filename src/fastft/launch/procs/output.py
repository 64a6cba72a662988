"""The workers' output, as torchrun shows it: every line a worker (or a warm spare) writes
to stdout or stderr reaches the agent's own stdout or stderr whole, prefixed with who
wrote it (``[rank 1.0]:`` for rank 1 in its first life, ``[spare 4242]:`` for a spare
that has not become a worker yet), so that lines from several ranks never interleave.
With ``--log-dir DIR`` each life's lines also go, unprefixed, to
``DIR/rank{R}/life{L}.stdout`` and ``.stderr``; ``--tee`` then says which streams still
reach the console (torchrun's ``--tee``: 0 none, 1 stdout, 2 stderr, 3 both).

A Python traceback that another rank (or life) already printed word for word is shown
once: the later ones become one line, ``RuntimeError: boom (the same traceback as rank
0.0)`` (8 ranks that fail at import print one traceback, not 8). ``--log-dir`` files keep
every line.

One reader thread per stream of each child. Workers run with ``PYTHONUNBUFFERED=1`` (a
pipe would otherwise hold their lines back in blocks).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

__all__ = ["Output"]

_LINE_MAX = 1 << 16
_TB_HEAD = b"Traceback (most recent call last):"
_TB_MAX_LINES = 400
"""A traceback block longer than this is shown as it is (not held back any longer)."""
_TB_REMEMBERED = 256


class Tracebacks:
    """Folds tracebacks already shown (see the module). One per agent, shared by the
    relays of every child; each relay feeds it its stderr lines through a :meth:`reader`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shown: dict[bytes, str] = {}
        """A traceback's text -> who showed it first (a prefix's label)."""

    def reader(self) -> _TracebackReader:
        return _TracebackReader(self)

    def first(self, text: bytes, who: str) -> str | None:
        """Who showed ``text`` before (None: nobody; ``who`` is now the one)."""
        with self._lock:
            seen = self._shown.get(text)
            if seen is None:
                if len(self._shown) >= _TB_REMEMBERED:
                    self._shown.pop(next(iter(self._shown)))
                self._shown[text] = who
            return seen


class _TracebackReader:
    """One stream's view: holds a traceback's lines until its last one (the exception's
    line, not indented), then gives back either all of them or that line alone."""

    def __init__(self, shared: Tracebacks) -> None:
        self.shared = shared
        self.held: list[bytes] = []

    def feed(self, line: bytes, who: str) -> list[bytes]:
        if not self.held:
            if line.rstrip(b"\r\n") == _TB_HEAD:
                self.held.append(line)
                return []
            return [line]
        self.held.append(line)
        if line[:1] in (b" ", b"\t") and len(self.held) < _TB_MAX_LINES:
            return []
        block, self.held = self.held, []
        if len(block) >= _TB_MAX_LINES:
            return block
        seen = self.shared.first(b"".join(block), who)
        if seen is None:
            return block
        return [line.rstrip(b"\r\n") + f" (the same traceback as {seen})\n".encode()]

    def flush(self) -> list[bytes]:
        block, self.held = self.held, []
        return block


class Output:
    """Relays children's stdout and stderr (see the module)."""

    def __init__(self, log_dir: str | None, tee: int) -> None:
        self.log_dir = Path(log_dir) if log_dir else None
        self.tee = tee if self.log_dir is not None else 3
        self._lock = threading.Lock()
        self._labels: dict[int, tuple[str, Path | None]] = {}
        """pid -> (prefix, the file stem for --log-dir or None)."""
        self._threads: list[tuple[Any, threading.Thread]] = []
        self.tracebacks = Tracebacks()

    @staticmethod
    def popen_kwargs() -> dict[str, Any]:
        return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}

    @staticmethod
    def env(env: dict[str, str]) -> dict[str, str]:
        return {**env, "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1")}

    def label(self, pid: int, rank: int | None, life: int = 0, name: str = "") -> None:
        """Who ``pid`` is from now on (a spare adopted as a worker changes its label);
        ``name``: a helper process of the agent's (the zygote)."""
        if name:
            self._labels[pid] = (f"[{name}]: ", None)
            return
        if rank is None:
            self._labels[pid] = (f"[spare {pid}]: ", None)
            return
        stem = None
        if self.log_dir is not None:
            d = self.log_dir / f"rank{rank}"
            d.mkdir(parents=True, exist_ok=True)
            stem = d / f"life{life}"
        self._labels[pid] = (f"[rank {rank}.{life}]: ", stem)

    def watch(self, proc: Any) -> None:
        """Relay ``proc``'s pipes until they close (label it first): a ``Popen``, or
        anything with its ``pid``, ``stdout``, ``stderr`` and ``returncode``."""
        for stream, name, console in (
            (proc.stdout, "stdout", sys.stdout),
            (proc.stderr, "stderr", sys.stderr),
        ):
            if stream is None:
                continue
            t = threading.Thread(
                target=self._relay,
                args=(proc.pid, stream, name, console),
                name=f"fastft-output-{proc.pid}-{name}",
                daemon=True,
            )
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x[1].is_alive()] + [(proc, t)]

    def flush(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until what the exited children wrote is relayed."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for proc, t in threads:
            if proc.returncode is not None:  # (set by the reaper; a live spare relays on)
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _relay(self, pid: int, stream: IO[bytes], name: str, console: IO[str]) -> None:
        files: dict[Path, IO[bytes]] = {}
        show = self.tee & (1 if name == "stdout" else 2)
        folds = self.tracebacks.reader() if name == "stderr" else None
        prefix = ""
        try:
            while line := stream.readline(_LINE_MAX):
                if not line.endswith(b"\n"):
                    line += b"\n"
                prefix, stem = self._labels.get(pid, (f"[pid {pid}]: ", None))
                if stem is not None:
                    path = stem.with_suffix(f".{name}")
                    f = files.get(path)
                    if f is None:
                        f = files[path] = open(path, "ab")  # noqa: SIM115 - kept open
                    f.write(line)
                    f.flush()
                if show:
                    lines = [line] if folds is None else folds.feed(line, prefix[1:-3])
                    self._show(console, prefix, lines)
            if show and folds is not None:
                self._show(console, prefix, folds.flush())
        except (OSError, ValueError):
            pass  # the console or a file went away: nothing left to relay to
        finally:
            for f in files.values():
                f.close()
            stream.close()

    def _show(self, console: IO[str], prefix: str, lines: list[bytes]) -> None:
        if not lines:
            return
        raw = getattr(console, "buffer", None)
        with self._lock:
            for line in lines:
                if raw is not None:
                    raw.write(prefix.encode() + line)
                else:  # (a console replaced by text-only stream)
                    console.write(prefix + line.decode(errors="replace"))
            console.flush()
