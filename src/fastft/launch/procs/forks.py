"""The agent's end of the node's zygote (:mod:`fastft.launch.procs.zygote`): it starts the
zygote, waits until it is warm, orders forks, and replaces it when it dies.

A worker forked by the zygote is the agent's child (the agent is a child subreaper): the
agent's reaper, exit trace and kills treat it as a worker it spawned. Its stdout and stderr
are pipes the agent makes and relays, as a spawned worker's. When the zygote cannot fork
one (it is still warming up, it died, the command is not a script of this Python, or a
fork would be unsafe), the worker is spawned instead, with the reason in the event log.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from fastft.launch.procs.output import Output
from fastft.launch.procs.zygote import MAX_ORDER
from fastft.process.env import ZYGOTE_FD, ZYGOTE_PRELOAD

__all__ = ["Forked", "Zygote", "forkable"]

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
ORDER_TIMEOUT_S = 10.0
"""The most a fork order may take (a fork is milliseconds; a zygote that does not answer
is killed and replaced)."""


@dataclass
class Forked:
    """A worker the zygote forked, as the agent sees it (what it uses of a ``Popen``)."""

    pid: int
    stdout: IO[bytes] | None = None
    stderr: IO[bytes] | None = None
    stdin: IO[bytes] | None = None
    returncode: int | None = field(default=None)


def forkable(argv: list[str], env: dict[str, str], python: str, base: dict[str, str]) -> str | None:
    """Why the zygote (started as ``python`` with environment ``base``) cannot run
    ``argv`` in ``env`` as a fork (None: it can): it runs a Python script or ``-m`` module
    of its own interpreter, with the same ``PYTHONPATH`` (read at the interpreter's
    start)."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(python):
        return f"not a script of {python}: {argv[:1]}"
    if argv[1].startswith("-") and not (argv[1] == "-m" and len(argv) >= 3):
        return f"interpreter flags ({argv[1]}) take effect at start only"
    for var in ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE"):
        if env.get(var) != base.get(var):
            return f"{var} differs from the zygote's (read at start only)"
    return None


class Zygote:
    """One zygote of the node (see the module). ``emit(event, **fields)``: the agent's
    event log; ``preexec``: run in the zygote before it starts (its death with the agent)."""

    def __init__(
        self,
        *,
        output: Output,
        preload: tuple[str, ...],
        env: dict[str, str],
        emit: Callable[..., None],
        preexec: Callable[[], None],
        python: str = sys.executable,
    ) -> None:
        self.output = output
        self.preexec = preexec
        self.preload = preload
        self.env = env
        self.emit = emit
        self.python = python
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.error: str | None = None
        """Why the current zygote is not usable (None while it warms up or once ready)."""
        self._stopping = False
        self._replace = False
        self.starts = 0

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start a zygote; it warms up in the background (:meth:`wait`)."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # its forks' middle processes exit
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**self.env, ZYGOTE_FD: str(theirs.fileno()), ZYGOTE_PRELOAD: ",".join(self.preload)}
        try:
            proc = subprocess.Popen(
                [self.python, "-c", "from fastft.launch.procs.zygote import main; main()"],
                env=self.output.env(env),
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                preexec_fn=self.preexec,
                **self.output.popen_kwargs(),
            )
        finally:
            theirs.close()
        self.output.label(proc.pid, None, name="zygote")
        self.output.watch(proc)
        with self._lock:
            self._sock, self._proc, self.error = ours, proc, None
            self._ready.clear()
            self.starts += 1
        self.emit("zygote_start", pid=proc.pid, preload=list(self.preload))
        threading.Thread(
            target=self._warm_up,
            args=(proc, ours, time.monotonic()),
            name="fastft-zygote",
            daemon=True,
        ).start()

    def wait(self, timeout_s: float) -> str | None:
        """Wait until the zygote is warm; why not (None: it is)."""
        if not self._ready.wait(timeout_s):
            return f"the zygote is not ready after {timeout_s:g} s"
        return self.error

    def stop(self) -> None:
        """End the zygote (its forks live on: they are the agent's children)."""
        with self._lock:
            self._stopping = True
            sock, proc = self._sock, self._proc
            self._sock = None
        if sock is not None:
            sock.close()  # (it would end at EOF, after its interpreter's teardown: ~1 s)
        if proc is not None and proc.poll() is None:
            self.emit("zygote_stop", pid=proc.pid)
            proc.kill()  # (idle, holding nothing: no need to wait for its teardown)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("the zygote (pid %d) did not end after SIGKILL", proc.pid)

    def _warm_up(self, proc: subprocess.Popen[bytes], sock: socket.socket, t0: float) -> None:
        """Thread: the zygote's first message (ready, or why not), then its exit."""
        try:
            got = json.loads(sock.recv(MAX_ORDER) or b"{}")
        except (OSError, ValueError):
            got = {}
        ready = bool(got.get("ready"))
        if ready:
            self.emit(
                "zygote_ready",
                pid=proc.pid,
                warm_up_ms=round((time.monotonic() - t0) * 1e3, 1),
                native_threads=got.get("native_threads"),
            )
            self._ready.set()
        code = proc.wait()
        with self._lock:
            current = self._proc is proc and not self._stopping
            if current:
                self.error = got.get("error") or (
                    f"the zygote exited (code {code})"
                    if ready
                    else f"the zygote exited with code {code} as it started"
                )
        self._ready.set()  # (not ready: wait() returns the error)
        if current and ready:  # a zygote that had worked: another one starts
            self.emit("zygote_exit", pid=proc.pid, code=code)
            log.warning("the zygote (pid %d) exited with %s: a new one starts", proc.pid, code)
            print(
                f"fastft: the zygote exited ({code}): restarts spawn until a new one is warm",
                file=sys.stderr,
                flush=True,
            )
            self._replace = True

    def tend(self) -> None:
        """From the agent's main thread, each turn of its loop: start the replacement of a
        zygote that died (a child's PR_SET_PDEATHSIG fires when the *thread* that started
        it ends: not from the thread that saw the death)."""
        if self._replace and not self._stopping:
            self._replace = False
            self.start()

    # --- forks -----------------------------------------------------------------------------
    def fork(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        call: str = "",
        keep: dict[int, int] | None = None,
        stdin: bool = False,
    ) -> Forked | str:
        """A worker forked with ``argv`` and ``env``, or why not (spawn it instead).
        ``call``: ``"module:function"`` to call instead of running ``argv`` (a warm
        spare); ``keep``: descriptors of the agent's that the child gets, by the number it
        sees them under; ``stdin``: a pipe to its stdin (``Forked.stdin``)."""
        why = None if call else forkable(argv, env, self.python, self.env)
        if why is not None:
            return why
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin else (-1, -1)
        fds = {1: out_w, 2: err_w, **({0: in_r} if stdin else {}), **(keep or {})}
        order = {"argv": argv, "env": env, "cwd": os.getcwd(), "fds": list(fds), "call": call}
        try:
            got = self._order(order, list(fds.values()))
        finally:
            for fd in (out_w, err_w, in_r):
                if fd >= 0:
                    os.close(fd)
        if isinstance(got, str):
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            return got
        return Forked(
            got,
            stdout=os.fdopen(out_r, "rb"),
            stderr=os.fdopen(err_r, "rb"),
            stdin=os.fdopen(in_w, "wb") if stdin else None,
        )

    def _order(self, order: dict[str, Any], fds: list[int]) -> int | str:
        with self._lock:
            sock = self._sock
            if sock is None or not self._ready.is_set() or self.error is not None:
                return self.error or "the zygote is warming up"
            try:
                sock.settimeout(ORDER_TIMEOUT_S)
                socket.send_fds(sock, [json.dumps(order).encode()], fds)
                reply = json.loads(sock.recv(MAX_ORDER) or b"{}")
            except (OSError, ValueError) as e:
                reply = {"error": f"the zygote did not answer ({e})"}
                if self._proc is not None:
                    self._proc.kill()  # (its thread starts another)
        if "pid" in reply:
            return int(reply["pid"])
        return str(reply.get("error") or "the zygote closed its socket")


def start_zygote(
    config: Any, output: Output, emit: Callable[..., None], preexec: Callable[[], None]
) -> tuple[Zygote | None, str | None]:
    """The node's zygote for ``fastft run`` (``config``: its LaunchConfig), warm, and why
    the job cannot start (a ``--preload`` module that fails or starts a thread). None with
    ``--start-method spawn``; a zygote that fails otherwise leaves the workers to spawn."""
    if config.start_method != "zygote":
        return None, None
    env = {
        **os.environ,
        **config.env,
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    }
    preload = tuple(n for n in config.preload.split(",") if n)
    preload += tuple(f"?{n}" for n in script_imports(config.command) if n not in preload)
    if config.checkpoint_dir:  # what each worker's forked checkpoint writer imports
        preload += ("?torch.distributed.checkpoint", "?fastft.runtime.durable.disk")
    if config.control:  # the NATS client each worker connects with (120-300 ms a start)
        preload += ("?nats", "?nats.js", "?nats.js.errors")
    z = Zygote(output=output, preload=preload, env=env, emit=emit, preexec=preexec)
    z.start()
    why = z.wait(ZYGOTE_START_S)
    if why is None:
        return z, None
    if why.startswith("--preload"):
        z.stop()
        return None, why
    log.warning("the zygote is not usable (%s): workers start as new processes", why)
    emit("zygote_unusable", why=why[:300])
    return z, None


_FRAMEWORKS = re.compile(
    rb"^\s*(?:import\s+jax\b|from\s+jax\b|import\s+fastft\.jax\b|from\s+fastft(?:\.jax\b|\s+import\s+jax\b))",
    re.MULTILINE,
)


def script_imports(command: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """What the zygote preloads for the worker script beyond torch and fastft, unasked:
    ``jax`` and ``fastft.jax`` when the script's source imports JAX (0.6 s of a restart
    here). The script is found as Python would (a path, or ``-m`` on ``sys.path``),
    read, not imported."""
    path = None
    if len(command) >= 3 and command[1] == "-m":
        parts = command[2].split(".")
        for root in ["", *sys.path]:
            base = os.path.join(root or os.getcwd(), *parts)
            for cand in (base + ".py", os.path.join(base, "__main__.py")):
                if os.path.isfile(cand):
                    path = cand
                    break
            if path:
                break
    elif len(command) >= 2 and command[1].endswith(".py"):
        path = command[1]
    try:
        with open(path or "", "rb") as f:
            source = f.read(1 << 20)
    except OSError:
        return ()
    return ("jax", "fastft.jax") if _FRAMEWORKS.search(source) else ()


ZYGOTE_START_S = 120.0
"""The most the first start waits for the zygote to warm up (then it spawns)."""
