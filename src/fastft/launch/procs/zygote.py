"""The node's zygote: a process that pays Python's start-up once (``import torch``, the
``torch._dynamo`` import the first optimizer triggers, fastft's runtime, and the modules
named by ``--preload``) and then only forks, on the agent's order. Every worker start and
restart of ``fastft run --start-method zygote`` (the default) is such a fork: milliseconds
instead of seconds (issue 37). The agent's end is :mod:`fastft.launch.procs.forks`.

An order is one message on a Unix socket (``SOCK_SEQPACKET``): a JSON object with the
worker's ``argv``, ``env`` and ``cwd`` and the descriptors it gets (``fds``: the child's
descriptor numbers, the descriptors themselves passed with ``SCM_RIGHTS``: its stdout and
stderr pipes, which the agent relays as a spawned worker's; a warm spare's stdin and
ready pipe too), or a function of fastft's to ``call`` instead (a warm spare's main). The zygote forks twice: the
middle process forks the worker and exits at once, so the worker becomes a child of the
agent (a child subreaper): the agent waits for it, traces it and kills it exactly as a
worker it spawned. The reply is ``{"pid": N}``, sent once the worker is the agent's.

What the zygote must never do, checked before each fork (the order is refused, and the
agent spawns the worker instead, saying why):

* hold a CUDA context (``torch.cuda.is_initialized()``): a forked context is unusable;
  each worker creates its own;
* run a Python thread besides its main one: a fork copies only the forking thread, and a
  lock another thread held stays locked in the child forever. A ``--preload`` module that
  starts one fails the job at start, naming the module;
* hold a process group, a store client or any socket but its agent's (checked: a
  ``--preload`` module that opens one fails the job at start).

In each worker, the random generators are reseeded (Python's, NumPy's when imported,
torch's), SIGINT takes its default handler back, the environment is the worker's own,
and ``torch.set_num_threads`` follows its ``OMP_NUM_THREADS``. The zygote registers no
``atexit`` handler; those its imports registered (logging's flush) run in each worker as
in a fresh process. Native thread pools that imports started (OpenBLAS) are fork-aware.

    python -c 'from fastft.launch.procs.zygote import main; main()'   # the agent, FASTFT_ZYGOTE_FD
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from fastft.process.env import ZYGOTE_FD, ZYGOTE_PRELOAD

__all__ = ["MAX_ORDER", "main", "unsafe"]

MAX_ORDER = 1 << 20
"""The largest order, in bytes (an environment of a few hundred variables is ~10 KiB)."""
_MAX_FDS = 8
_PR_SET_PDEATHSIG = 1
_REPARENT_S = 2.0


def unsafe(own: int = -1) -> str | None:
    """Why a fork now would hand its child something broken (None: it is safe); ``own``:
    the zygote's socket to its agent (the one socket it may hold)."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return "threads are running in the zygote: " + ", ".join(_describe(t) for t in others)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the zygote holds a CUDA context (a forked one is unusable)"
    sockets = _sockets() - {own}
    if sockets:  # (a store client, a process group, a connection a preload opened)
        return f"the zygote holds {len(sockets)} socket(s) besides its agent's"
    return None


def _sockets() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:
            pass  # (the directory's own descriptor, closed by now)
    return out


def _describe(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)
    where = getattr(target, "__module__", None) or type(t).__module__
    return f"{t.name!r} (started by {where})"


def _preload(names: list[str]) -> str | None:
    """Import the ``--preload`` modules, one at a time; the first that fails, or that
    leaves a thread running, ends the zygote with that reason. A name that starts with
    ``?`` was not asked for (the agent added it: the script imports JAX) and one that
    fails to import is skipped: the workers import it themselves, and say why."""
    for name in names:
        optional, name = name.startswith("?"), name.removeprefix("?")
        before = set(threading.enumerate())
        try:
            importlib.import_module(name)
        except BaseException as e:  # (its error, once, for the job's failure)
            if optional:
                continue
            tail = "".join(traceback.format_exception_only(type(e), e)).strip()
            return f"--preload {name}: the import failed: {tail}"
        new = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if new:
            return (
                f"--preload {name} started a thread ({', '.join(_describe(t) for t in new)}): "
                "a fork would copy its locks, not the thread; preload it in the script "
                "instead, or use --start-method spawn"
            )
    return None


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the agent's group)
    sock = socket.socket(fileno=int(os.environ.pop(ZYGOTE_FD)))
    names = [n for n in os.environ.pop(ZYGOTE_PRELOAD, "").split(",") if n]
    t0 = time.monotonic()
    from fastft.launch.procs.spare import warm_imports

    warm_imports()
    why = unsafe(sock.fileno()) or _preload(names)
    if why is None and (after := unsafe(sock.fileno())) is not None:
        why = f"--preload {','.join(names)}: after its imports, {after}"
    if why is not None:
        sock.send(json.dumps({"error": why}).encode())
        sys.exit(2)
    tasks = len(os.listdir("/proc/self/task"))
    took = round((time.monotonic() - t0) * 1e3, 1)
    sock.send(json.dumps({"ready": True, "warm_up_ms": took, "native_threads": tasks}).encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_ORDER, _MAX_FDS)
        except OSError:
            return
        if not msg:  # the agent closed its end: it is done, or gone
            return
        reply = _serve(sock, msg, fds)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(reply).encode())


def _serve(sock: socket.socket, msg: bytes, fds: list[int]) -> dict[str, Any]:
    try:
        order = json.loads(msg)
        targets = [int(n) for n in order["fds"]]
        if len(targets) != len(fds):
            return {"error": f"{len(fds)} descriptors for {len(targets)} targets"}
    except (ValueError, KeyError, TypeError) as e:
        return {"error": f"a malformed order: {e}"}
    why = unsafe(sock.fileno())
    if why is not None:
        return {"error": why}
    sys.stdout.flush()
    sys.stderr.flush()
    agent = os.getppid()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the worker, say its pid, leave
        try:
            os.close(r)
            pid = os.fork()
        except BaseException:
            os._exit(1)
        if pid == 0:  # the worker (what it raises ends it, as in a fresh process)
            os.close(w)
            _become(order, sock, dict(zip(targets, fds, strict=True)), agent)
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 64):
        got += chunk
    os.close(r)
    os.waitpid(middle, 0)  # gone: the worker is the agent's child now
    if not got:
        return {"error": "the middle process failed to fork"}
    return {"pid": int(got)}


def _become(order: dict[str, Any], sock: socket.socket, fds: dict[int, int], agent: int) -> None:
    """In the worker: wait to be the agent's child, take the order's descriptors,
    environment and working directory, reseed, and run the script as ``python`` would.
    Never returns: the script's end is the process's."""
    deadline = time.monotonic() + _REPARENT_S
    while os.getppid() != agent:  # (the middle process exits at once)
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0002)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # no worker outlives its agent
    if os.getppid() != agent:
        os._exit(1)
    sock.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for target, fd in fds.items():
        os.dup2(fd, target)
    for fd in set(fds.values()) - set(fds):  # (received under another number)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    _reseed()
    argv: list[str] = order["argv"]
    if order.get("call"):  # a function of fastft's (a warm spare: fastft.launch.procs.spare:main)
        module, _, name = order["call"].partition(":")
        sys.argv = argv[:1]
        getattr(importlib.import_module(module), name)()
        sys.exit(0)
    from fastft.launch.procs.spare import run_script

    run_script(argv)  # (its checkpoint writer forked first: one thread here)


def _reseed() -> None:
    """Every fork starts with the zygote's generators: give each its own, as a fresh
    process has (the runtime seeds each step from the job's seed anyway)."""
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    import torch

    torch.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
