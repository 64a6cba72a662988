"""The durable tier: checkpoints of the committed state, for when no live member holds it.

Peer healing covers a fault that leaves a holder of the committed state; this tier covers
the rest (every holder lost at once, or the whole job stopped): ``fastft run
--checkpoint-dir DIR``.

* **What and when.** The registered state (model, optimizer, other registered objects,
  the step) of a committed step, every ``every`` steps and/or ``interval_s`` seconds
  (:func:`due`). Every member holds the same state (S3), so one member writes: the
  epoch's first. RNG needs no saving: the runtime reseeds from (seed, step, rank).
* **Asynchronous.** The step loop pays for a copy of the tensors into a shared-memory
  buffer; a writer process (:mod:`fastft.runtime.durable.writer`) writes that buffer as
  one file (directly, not through the page cache: :mod:`.disk`) plus the state's
  structure, then the manifest (sizes and SHA-256 of every file), then renames the
  directory into place: a checkpoint is visible whole or not at all. A checkpoint due while the previous one is still being
  written is deferred to the first commit after it (an event), never waited for. A
  failed write is an event and a warning, never a training fault.
* **Restore.** :meth:`Checkpoints.latest` verifies the manifest of the newest checkpoint
  and falls back to the one before it, with an error in the log, if a file is missing,
  truncated or altered; it first waits (up to 30 s) for a newer one that a writer whose
  worker died is still completing. The structure is JSON (``fastft.runtime.state.tree``),
  and the tensors raw bytes at the manifest's offsets: reading a checkpoint runs no code
  (a format-2 checkpoint of an earlier fastft is DCP's, whose ``.metadata`` is a pickle
  torch reads: still loaded).

Layout: ``DIR/step-00000040/{tensors.bin, structure.json, fastft.json}``; a write
in progress is ``DIR/.tmp-step-00000040-<host>-<writer pid>`` (never read; removed by the
next writer on that host once that process is gone, by any after a day).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fastft.runtime.state.tree as tree  # the heal's: the structure as JSON, tensors apart
from fastft.process.events import EventLog
from fastft.process.teardown import join_at_exit
from fastft.runtime.durable.disk import (
    STRUCTURE,
    CheckpointError,
    checkpoint_name,
    fill,
    layout,
    load_tensors,
    padded,
    parse_tmp,
    staged,
    tmp_name,
    verify,
    write_checkpoint,
    write_flat,
)
from fastft.runtime.durable.writer import SharedBuffer, WriterProcess, process_alive

warnings.filterwarnings(  # no_dist=True says so already (format 2's load)
    "ignore", message="torch.distributed is disabled", category=UserWarning
)

__all__ = ["CheckpointError", "Checkpoints", "Saved", "due", "verify", "write_checkpoint"]

log = logging.getLogger(__name__)

JOIN_AT_CLOSE_S = 120.0
"""How long a worker that ends cleanly waits for its last checkpoint to be written."""
WAIT_FOR_WRITER_S = 30.0
"""How long a restore waits for a newer checkpoint that a live writer is still writing."""


def due(
    step: int, *, last_step: int, last_time: float, now: float, every: int, interval_s: float
) -> bool:
    """Whether committed ``step`` is checkpointed: every ``every`` steps (0: not by
    steps) or once ``interval_s`` seconds have passed since the last one (0: not by time)."""
    if step <= last_step:
        return False
    if every > 0 and step % every == 0:
        return True
    return interval_s > 0 and now - last_time >= interval_s


@dataclass(frozen=True)
class Saved:
    """A complete checkpoint: the committed ``step`` it holds, and where."""

    step: int
    path: Path


class Checkpoints:
    """One worker's view of the checkpoint directory: writes (one at a time, by a writer
    process of its own, :mod:`fastft.runtime.durable.writer`), finds and verifies, loads."""

    def __init__(
        self, root: str | os.PathLike[str], keep: int, events: EventLog, *, process: bool = True
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least one checkpoint")
        self.root = Path(root)
        self.keep = keep
        self.events = events
        self.last_step = -1
        self.last_time = time.monotonic()
        self.written = 0
        self.failing: list[str] = []
        """The errors of the checkpoints that failed since the last one written."""
        self.deferred = False
        """A checkpoint fell due while a write ran: the next commit after it takes it."""
        self._thread: threading.Thread | None = None
        self._writer = WriterProcess() if process else None
        self._buf: SharedBuffer | None = None
        self._prepared = False
        self._starting: threading.Thread | None = None
        """The writer process's start (prepare), which a first write waits for."""
        self.skipped = 0
        """Checkpoints skipped because the previous write was still running."""

    # --- writing ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Start the writer process now (it imports torch: a second or two), so that the
        first checkpoint does not wait for it. Called by the epoch's first member at each
        commit: once (a writer that died later is started again by the next write)."""
        if self._prepared or self._writer is None or self.busy:
            return
        self._prepared = True
        self._starting = threading.Thread(
            target=self._guarded, args=(self._writer.start,), name="fastft-ckpt", daemon=True
        )
        self._starting.start()

    @property
    def busy(self) -> bool:
        """A write is running (a writer still starting is not: a checkpoint due meanwhile
        is staged now and handed over once it is up, not skipped)."""
        return self._thread is not None and self._thread.is_alive()

    def save_async(self, step: int, epoch: int, state: dict[str, Any]) -> bool:
        """Stage committed ``state`` (``state["step"] == step``; the live objects: they are
        copied here) and hand it to the writer; False (and an event) if the previous write
        is still running: the checkpoint is then :attr:`deferred` to the first commit after
        that write (never queued behind it). The step loop pays for the copy alone."""
        self.last_step, self.last_time = step, time.monotonic()
        if self.busy:
            if not self.deferred:
                self.skipped += 1
                self.events.emit(
                    "checkpoint_skipped",
                    step=step,
                    reason="previous write running",
                    skipped=self.skipped,
                )
            self.deferred = True
            return False
        self.deferred = False
        job = self._stage(step, epoch, state)
        if job is not None:
            target: Any = self._after_start
            args: tuple[Any, ...] = (step, job, self._starting)
        else:
            target, args = self._save, (step, epoch, staged(state))
        self._thread = threading.Thread(target=target, args=args, name="fastft-ckpt", daemon=True)
        self._thread.start()
        join_at_exit(self._thread)  # a process that ends meanwhile finishes the write
        return True

    def _stage(self, step: int, epoch: int, state: dict[str, Any]) -> dict[str, Any] | None:
        """Copy the state's tensors into the shared buffer; the writer's job, or None if
        there is no writer process or no shared memory (the write then runs here)."""
        if self._writer is None:
            return None
        tensors: list[torch.Tensor] = []
        structure = tree.dump(state, tensors)
        entries, nbytes = layout(tensors)
        try:
            b = self._buf
            if (
                b is None
                or b.nbytes < padded(nbytes)
                or not (self._writer.mapped == b.path or os.path.exists(b.path))
            ):  # none yet, too small, or unlinked by a writer that died since
                if b is not None:
                    b.unlink()
                self._buf = b = SharedBuffer(max(nbytes, 1))
        except (OSError, RuntimeError) as e:
            log.warning("no shared memory for the checkpoint writer (%s): writing in-process", e)
            if self._starting is not None:  # (prepare's start, not yet run, would leak one)
                self._starting.join(5.0)
            self._writer.close(timeout_s=5.0)  # (started by prepare: idle, ends at once)
            self._writer = None
            return None
        fill(b.flat, entries, tensors)
        job = {"step": step, "epoch": epoch, "root": str(self.root), "nbytes": nbytes}
        return {**job, "structure": structure, "entries": entries}

    def wait(self, timeout_s: float = JOIN_AT_CLOSE_S) -> None:
        """Wait for the write in progress."""
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                log.warning("checkpoint writer still busy after %.0f s: left behind", timeout_s)

    def close(self, timeout_s: float = JOIN_AT_CLOSE_S) -> None:
        """Wait for the write in progress (a clean end keeps its last checkpoint), then end
        the writer process."""
        self.wait(timeout_s)
        if self._starting is not None:
            self._starting.join(timeout_s)
        if self._writer is not None:
            self._writer.close(timeout_s)

    def _guarded(self, fn: Any) -> None:
        try:
            fn()
        except Exception as e:
            log.warning("checkpoint writer process did not start (%s): writing in-process", e)
            self._writer = None

    def _after_start(
        self, step: int, job: dict[str, Any], starting: threading.Thread | None
    ) -> None:
        """Hand ``job`` to the writer once its start (if one is running) is over."""
        if starting is not None:
            starting.join()
        if self._writer is None:  # it could not start: the write falls to this process next
            self._done(step, {"ok": False, "error": "the writer process did not start"})
            return
        self._hand_over(step, job)

    def _hand_over(self, step: int, job: dict[str, Any]) -> None:
        assert self._writer is not None and self._buf is not None
        try:
            # named now, before the writer (maybe still importing torch) starts on it: a
            # restore after every worker died sees that a live writer has this step
            pid = self._writer.start()
            (self.root / tmp_name(step, pid)).mkdir(parents=True, exist_ok=True)
            answer = self._writer.write(self._buf, job)
        except (OSError, EOFError) as e:
            answer = {"ok": False, "error": f"writer process: {type(e).__name__}: {e}"}
        self._done(step, answer)

    def _save(self, step: int, epoch: int, staged: tuple[Any, ...]) -> None:
        t0 = time.monotonic()
        try:
            path, size = write_flat(self.root, step, epoch, *staged)
            answer = {"ok": True, "path": str(path), "size": size}
        except Exception as e:
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        answer["write_ms"] = round((time.monotonic() - t0) * 1e3, 3)
        self._done(step, answer)

    def _done(self, step: int, a: dict[str, Any]) -> None:
        if not a["ok"]:
            log.warning("checkpoint of step %d failed: %s", step, a["error"])
            self.events.emit("checkpoint_failed", step=step, error=a["error"])
            self.failing.append(f"step {step}: {a['error']}")
            return
        self.written += 1
        self.failing = []
        self.events.emit(
            "checkpoint",
            step=step,
            path=a["path"],
            mb=round(a["size"] / 2**20, 3),
            write_ms=a.get("write_ms"),
            cpu_ms=a.get("cpu_ms"),
        )
        self._prune()

    def _prune(self) -> None:
        done = self._listing()
        for s in done[self.keep :]:
            shutil.rmtree(s.path, ignore_errors=True)
        for p in self.root.glob(".tmp-step-*"):
            if _writing(p) is False:
                shutil.rmtree(p, ignore_errors=True)  # a writer that died mid-write

    # --- finding and loading ---------------------------------------------------------------
    def _listing(self) -> list[Saved]:
        out = []
        for p in self.root.glob("step-*"):
            try:
                out.append(Saved(int(p.name.removeprefix("step-")), p))
            except ValueError:
                continue
        return sorted(out, key=lambda s: -s.step)

    def has(self, step: int) -> bool:
        """Whether a complete checkpoint of ``step`` or later is in the directory (whoever
        wrote it: a directory is renamed into place whole)."""
        done = self._listing()
        return bool(done) and done[0].step >= step

    def latest(self, wait_s: float = WAIT_FOR_WRITER_S) -> Saved | None:
        """The newest checkpoint that verifies; an unusable newer one is logged (an
        error and an event) and passed over. A newer one still being written by a live
        writer (whose worker died: it finishes the write it was handed) is waited for, up
        to ``wait_s``: every worker lost in one step then loses less."""
        if not self.root.is_dir():
            return None
        self._wait_for_writers(wait_s)
        for s in self._listing():
            try:
                verify(s.path)
            except CheckpointError as e:
                log.error("checkpoint %s is unusable, falling back to an older one: %s", s.path, e)
                self.events.emit("checkpoint_unusable", step=s.step, error=str(e))
                continue
            return s
        return None

    def _wait_for_writers(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        announced: set[str] = set()
        while True:
            done = self._listing()
            newest = done[0].step if done else -1
            live = [  # (a writer on another host cannot be told alive: not waited for)
                p.name
                for p in self.root.glob(".tmp-step-*")
                if parse_tmp(p.name)[0] > newest and _writing(p) is True
            ]
            if not live or time.monotonic() >= deadline:
                for name in live:
                    log.warning("checkpoint %s still being written after %.0f s", name, wait_s)
                return
            for name in set(live) - announced:
                log.warning("waiting for checkpoint %s, still being written", name)
                self.events.emit("checkpoint_wait", name=name)
            announced.update(live)
            time.sleep(0.05)

    def path_of(self, step: int) -> Path:
        return self.root / checkpoint_name(step)

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """The state saved in ``path`` (as ``StateRegistry.state`` gave it)."""
        manifest = verify(path)
        by_index = load_tensors(path, manifest)
        try:
            state = tree.load((path / STRUCTURE).read_bytes(), by_index)
        except ValueError as e:
            raise CheckpointError(f"{path}: {STRUCTURE}: {e}") from None
        if int(state["step"]) != int(manifest["step"]):
            raise CheckpointError(f"{path}: holds step {state['step']}, not {manifest['step']}")
        return state


STALE_TMP_S = 86400.0
"""A write in progress by another host's writer, untouched this long, is abandoned."""


def _writing(p: Path) -> bool | None:
    """Whether the write in progress ``p`` still has a live writer: True, False (dead, or
    not a name this module makes), or None (another host's, recently touched: unknown)."""
    step, host, pid = parse_tmp(p.name)
    if step < 0:
        return False
    if host == socket.gethostname():
        return process_alive(pid)
    try:
        return None if time.time() - p.stat().st_mtime < STALE_TMP_S else False
    except OSError:
        return False
