"""The checkpoint writer process: the durable tier's writes, off the worker's GIL.

A writer *thread* shared the worker's interpreter: the step loop (whose collectives poll,
taking the GIL every few hundred microseconds) queued behind the writer's Python code,
and a lowered writer descheduled while it held the GIL stalled it outright (+16.8 % mean
step time at nice 10, +4.3 % at nice 0; docs/measurements.md). The writer is a process of
its own instead, as torch's ``async_save`` with a process checkpointer:

* the worker stages the committed state's tensors into one shared-memory buffer (the step
  loop's only cost: that copy) and hands the writer a small header (the state's structure
  with its tensors as references, and where each tensor lies in the buffer);
* the writer maps the buffer, writes it with :func:`fastft.runtime.durable.disk.write_flat`
  (one direct write of the buffer as it lies) and answers with the result; one write at a
  time.
* A worker forked from the node's zygote forks its writer at its start, before the
  script runs (:func:`fork_writer`: the process has one thread then, and torch
  imported): ready at once. Otherwise the writer is started as ``python -c``
  :func:`main` (not with ``multiprocessing``: a spawned child would import the user's
  script again) when the first member registers, and is up ~3 s later (``import
  torch``): checkpoints due meanwhile waited for it, and a total loss in those seconds
  restored an older one (issue 48, 6).
* The writer ends when told or when its pipe closes, after the write in progress: a
  checkpoint staged just before every worker died is still completed.

Messages are pickles, length-prefixed, on the child's stdin and stdout (a pipe between two
processes of the same job: trusted like the checkpoint directory itself).
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import torch

from fastft.runtime.durable.disk import padded

__all__ = ["SharedBuffer", "WriterProcess", "fork_writer", "main", "process_alive"]

_LEN = struct.Struct("<Q")
WRITER_NICE = 19
"""The writer process yields the CPU to training: it holds no lock the workers need (its
own interpreter), so a low priority inverts nothing (a writer *thread* at nice 10 stalled
the step loop behind the GIL it held: +16.8 %)."""
_MAIN = "import sys; from fastft.runtime.durable.writer import main; sys.exit(main())"
"""(Not ``-m fastft.runtime.durable.writer``: the package imports this module first.)"""
_PREFIX = "fastft-ckpt-"


def _send(f: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _recv(f: IO[bytes]) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other end closed the pipe")
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the other end closed the pipe mid-message")
    return pickle.loads(data)


class SharedBuffer:
    """A flat byte tensor in shared memory (a file under /dev/shm, unlinked once the writer
    has mapped it), reused from one checkpoint to the next while it is large enough."""

    def __init__(self, used: int) -> None:
        nbytes = padded(used)  # (a direct write's whole blocks)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        _sweep(shm)
        fd, self.path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=shm)
        try:
            # reserved now: a tmpfs too small for it (64 MB in a default Docker container)
            # fails here with ENOSPC, not later with a SIGBUS in the staging copy
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.nbytes = nbytes
        self.flat = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _sweep(shm: str) -> None:
    """Remove the buffers of workers that are gone: one whose worker and writer both died
    before the writer mapped it (a job killed whole) would hold its memory until reboot."""
    try:
        names = os.listdir(shm)
    except OSError:
        return
    for name in names:
        if name.startswith(_PREFIX) and not process_alive(name[len(_PREFIX) :].split("-", 1)[0]):
            try:
                os.unlink(os.path.join(shm, name))
            except OSError:
                pass


def process_alive(pid: str) -> bool:
    """Whether process ``pid`` (named in a file name: a writer, a worker) still runs here; a
    zombie does not (a killed writer whose worker died too waits for init to reap it)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except ValueError:
        return False
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no /proc
        pass
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Child:
    """A writer :func:`fork_writer` forked, as :class:`WriterProcess` uses a ``Popen``."""

    def __init__(self, pid: int, to_writer: int, from_writer: int) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = os.fdopen(to_writer, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(from_writer, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1  # (reaped elsewhere)
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"writer {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


_forked: _Child | None = None
"""The writer :func:`fork_writer` forked at this worker's start, until a write takes it."""


def fork_writer() -> None:
    """Fork this worker's checkpoint writer now (its first checkpoint then finds it
    ready). Only in a process with one thread and nothing held that a fork would break: a
    zygote's fork before the script runs (:mod:`fastft.launch.procs.zygote`). The writer
    ignores SIGINT (it finishes the write in progress when its worker dies) and keeps
    stderr (the worker's); everything else it inherited is closed."""
    global _forked
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 1
        try:
            import signal

            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.dup2(to_r, 0)
            os.dup2(from_w, 1)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            code = main()
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(to_r)
    os.close(from_w)
    _forked = _Child(pid, to_w, from_r)


class WriterProcess:
    """The worker's end: starts the writer, sends it one write at a time, waits for the
    answer (on the caller's thread: the durable tier's waiter thread)."""

    def __init__(self) -> None:
        self._p: subprocess.Popen[bytes] | _Child | None = None
        self._mapped: str | None = None

    def write(self, buf: SharedBuffer, job: dict[str, Any]) -> dict[str, Any]:
        """Have the writer save ``job`` (see :func:`main`) from ``buf``; its answer."""
        p = self._start()
        assert p.stdin is not None and p.stdout is not None
        if self._mapped != buf.path:
            job = {**job, "map": (buf.path, buf.nbytes)}
        try:
            _send(p.stdin, job)
            answer = _recv(p.stdout)
        except (OSError, EOFError):
            # the writer died: reaped now, so that the next write starts another (its pipe
            # closes before it can be waited for: a poll then still saw it running)
            p.kill()
            p.wait()
            self._p = None
            raise
        if "map" in job:
            self._mapped = buf.path
            buf.unlink()  # (the writer unlinked it once it had it mapped)
        return answer

    @property
    def mapped(self) -> str | None:
        """The buffer the running writer has mapped (None after a restart)."""
        return self._mapped

    def start(self) -> int:
        """Start the writer if it is not running (it then imports torch); its pid."""
        return self._start().pid

    def _start(self) -> subprocess.Popen[bytes] | _Child:
        global _forked
        if self._p is None or self._p.poll() is not None:
            self._mapped = None
            forked, _forked = _forked, None
            if forked is not None and forked.poll() is None:
                self._p = forked
                return forked
            self._p = subprocess.Popen(
                [sys.executable, "-c", _MAIN],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        return self._p

    def close(self, timeout_s: float) -> None:
        """Tell the writer to end (after its write in progress) and wait for it. Told, not
        left to see its pipe close: a process forked from the worker since (a data
        loader's workers) holds the pipe open, and the worker waited on the writer at its
        clean end until it was killed as hung (seen in a fault test)."""
        p, self._p = self._p, None
        if p is None:
            return
        try:
            if p.stdin is not None:
                _send(p.stdin, None)
                p.stdin.close()
            p.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait()


def main() -> int:
    """The writer: answer each job on stdin, until it closes. A job: ``step``, ``epoch``,
    ``root``, ``structure`` (the state's JSON structure, its tensors as references),
    ``entries`` (their layout in the buffer), ``nbytes`` (the buffer's bytes in use), and
    ``map`` (path, size) when the buffer is
    new."""
    from fastft.runtime.durable.disk import write_flat

    try:
        os.setpriority(os.PRIO_PROCESS, 0, WRITER_NICE)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        pass

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    flat: torch.Tensor | None = None
    while True:
        try:
            job = _recv(stdin)
        except EOFError:
            return 0  # the worker is gone (and nothing forked from it holds the pipe)
        if job is None:
            # every answer is sent and every file synced: nothing for the interpreter's
            # teardown to do but take time (at nice 19 on a busy machine, seconds, which
            # the worker's clean end would wait for)
            os._exit(0)
        t0, c0 = time.monotonic(), time.process_time()
        try:
            if "map" in job:
                path, nbytes = job["map"]
                flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                try:
                    os.unlink(path)  # both ends have it mapped: nothing left if either dies
                except FileNotFoundError:
                    pass
            assert flat is not None, "no buffer mapped"
            path_out, size = write_flat(
                job["root"],
                job["step"],
                job["epoch"],
                job["structure"],
                job["entries"],
                flat,
                job["nbytes"],
            )
            answer = {"ok": True, "path": str(path_out), "size": size}
        except Exception as e:
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        answer["write_ms"] = round((time.monotonic() - t0) * 1e3, 3)
        answer["cpu_ms"] = round((time.process_time() - c0) * 1e3, 3)  # all its threads
        try:
            _send(stdout, answer)
        except (BrokenPipeError, OSError):
            return 0  # the worker is gone; its write is done


if __name__ == "__main__":
    sys.exit(main())
