"""The agent's pool of warm spares (:mod:`fastft.launch.procs.spare` is the spare process):
started ahead, told ready through a pipe, handed to a restart (:func:`policy.pick_spare`),
replaced once the worker it became recovered (:func:`policy.spare_owed_done`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import fastft.launch.rules.policy as policy
from fastft.launch.procs.forks import Forked, Zygote
from fastft.launch.procs.output import Output
from fastft.launch.settings.config import LaunchConfig
from fastft.process.env import (
    CUDA_DEVICE,
    PREFAULT_MB,
    READY_FD,
    SPARE_FEWEST,
    SPARE_RUN_AHEAD,
    SPARE_WORLD,
)
from fastft.process.events import EventLog

__all__ = ["SparePool"]

log = logging.getLogger(__name__)

READY_TARGET = 10
"""The descriptor number of a forked spare's ready pipe."""


class SparePool:
    def __init__(
        self,
        config: LaunchConfig,
        events: EventLog,
        *,
        reap: Callable[[int], None],
        preexec: Callable[[], None],
        gpus: int = 0,
        output: Output | None = None,
    ) -> None:
        """``reap(pid)``: watch the spare's exit; ``gpus``: GPUs the spares warm (0: none);
        ``output``: relays the spares' stdout and stderr (None: a new one)."""
        self.output = output if output is not None else Output(None, 3)
        self.config = config
        self.events = events
        self._reap = reap
        self._preexec = preexec
        self.gpus = gpus
        self._lock = threading.Lock()
        self._spares: list[subprocess.Popen[bytes] | Forked] = []
        self._gpu: dict[int, int] = {}
        """pid -> the GPU a spare warmed (only where there are GPUs and spare_cuda)."""
        self._dead: set[int] = set()
        self._ready: set[int] = set()
        """pids of spares that said they are warm (:meth:`_await_ready`)."""
        self._owed: list[tuple[float, Any, int]] = []
        """(deadline, slot, incarnation) of each spare handed out and not yet replaced."""
        self.zygote: Zygote | None = None
        """The node's zygote (set by the agent): spares are its forks."""

    def gpu_of(self, local_rank: int) -> int | None:
        """The GPU a worker of this local rank trains on, by torchrun's convention (the
        demo's too): ``cuda:LOCAL_RANK`` modulo the GPUs visible; None when spares warm
        no GPU."""
        return local_rank % self.gpus if self.gpus else None

    def __bool__(self) -> bool:
        return bool(self._spares)

    def start(self, gpu: int | None = None) -> None:
        env = {**os.environ, **self.config.env}
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        if gpu is not None:
            env[CUDA_DEVICE] = str(gpu)
        env[PREFAULT_MB] = str(self.config.spare_prefault_mb)
        if self.config.spare_run_ahead:
            env[SPARE_RUN_AHEAD] = json.dumps(list(self.config.command))
            env[SPARE_WORLD] = str(self.config.world_size)
            env[SPARE_FEWEST] = str(self.config.min_replicas or 0)
        ready_r, ready_w = os.pipe()
        env[READY_FD] = str(ready_w)
        t0 = time.monotonic()
        p: subprocess.Popen[bytes] | Forked | None = None
        how = "spawn"
        if self.zygote is not None:  # a fork: its warm-up is the zygote's, done already
            env[READY_FD] = str(READY_TARGET)
            got = self.zygote.fork(
                list(self.config.command[:1]),
                self.output.env(env),
                call="fastft.launch.procs.spare:main",
                keep={READY_TARGET: ready_w},
                stdin=True,
            )
            p, how = (got, "fork") if isinstance(got, Forked) else (None, got)
            if p is None:
                env[READY_FD] = str(ready_w)
        try:
            p = p or subprocess.Popen(
                # not `-m fastft.launch.procs.spare`: the package imports that module first, and
                # runpy warns that it runs a module already in sys.modules
                [
                    self.config.command[0],
                    "-c",
                    "from fastft.launch.procs.spare import main; main()",
                ],
                env=self.output.env(env),
                stdin=subprocess.PIPE,
                pass_fds=(ready_w,),
                preexec_fn=self._preexec,
                **self.output.popen_kwargs(),
            )
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        self.output.label(p.pid, None)
        self.output.watch(p)
        self.track(p, gpu)
        self._reap(p.pid)
        threading.Thread(
            target=self._await_ready,
            args=(p.pid, ready_r, t0),
            name=f"fastft-spare-ready-{p.pid}",
            daemon=True,
        ).start()
        self.events.emit("spare_start", pid=p.pid, gpu=gpu, how=how[:200])

    def track(self, proc: Any, gpu: int | None) -> None:
        """Add a started spare (``proc``: a Popen or anything with ``pid`` and ``stdin``)."""
        with self._lock:
            self._spares.append(proc)
            if gpu is not None:
                self._gpu[proc.pid] = gpu

    def mark_ready(self, pid: int) -> None:
        with self._lock:
            self._ready.add(pid)

    def _await_ready(self, pid: int, fd: int, t0: float) -> None:
        """Thread: the spare writes one byte once it is warm (EOF: it ended first)."""
        try:
            got = os.read(fd, 1)
        except OSError:
            got = b""
        finally:
            os.close(fd)
        if not got:
            return
        self.mark_ready(pid)
        self.events.emit("spare_ready", pid=pid, warm_up_ms=round((time.monotonic() - t0) * 1e3, 1))

    def mark_dead(self, pid: int) -> bool:
        """A child exited: if it is an idle spare, it is never handed out. True if it was."""
        with self._lock:
            idle = any(p.pid == pid for p in self._spares)
            if idle:
                self._dead.add(pid)
        return idle

    def idle_exited(self, info: os.waitid_result) -> None:
        """A spare ended before it was needed: not replaced (it would likely end again);
        the next lost worker starts cold if no other spare is left."""
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        hint = (
            ": with --spare-run-ahead a spare runs the script up to fastft.init() before it "
            "knows its rank; a script that needs its rank (or anything `fastft run` sets per "
            "worker) before fastft.init() cannot use it (its traceback is above)"
            if self.config.spare_run_ahead
            else ""
        )
        log.warning("warm spare %d ended before it was needed (%d)%s", info.si_pid, code, hint)
        self.events.emit("spare_exit", pid=info.si_pid, code=code)

    def take(self, gpu: int | None = None) -> tuple[subprocess.Popen[bytes] | Forked, bool] | None:
        """A live spare and whether it was ready (:func:`policy.pick_spare`)."""
        with self._lock:
            self._spares = [p for p in self._spares if p.pid not in self._dead]
            infos = [
                policy.SpareInfo(p.pid, self._gpu.get(p.pid), p.pid in self._ready)
                for p in self._spares
            ]
            pick = policy.pick_spare(infos, gpu)
            if pick is None:
                return None
            p = next(p for p in self._spares if p.pid == pick.pid)
            self._spares.remove(p)
            self._gpu.pop(p.pid, None)
            self._ready.discard(p.pid)
            return p, pick.ready

    def owe(self, slot: Any) -> None:
        """A spare was handed to ``slot``: the next failure gets one too, once it recovered."""
        with self._lock:
            self._owed.append(
                (time.monotonic() + policy.SPARE_REFILL_MAX_S, slot, slot.incarnation)
            )

    @property
    def owed(self) -> bool:
        return bool(self._owed)

    def refill(
        self, now: float, committed: Callable[[Any], bool], gpu_of_slot: Callable[[Any], int | None]
    ) -> None:
        """Start the spares owed whose worker committed (``committed(slot)``), died again,
        ended, or waited ``SPARE_REFILL_MAX_S``."""
        with self._lock:
            owed, self._owed = self._owed, []
        keep = []
        for deadline, slot, inc in owed:
            same = slot.incarnation == inc
            if policy.spare_owed_done(
                now=now,
                deadline=deadline,
                same_life=same,
                slot_done=slot.done,
                committed=same and committed(slot),
            ):
                self.start(gpu_of_slot(slot))
            else:
                keep.append((deadline, slot, inc))
        with self._lock:
            self._owed = keep + self._owed

    def stop(self) -> None:
        with self._lock:
            spares, self._spares = self._spares, []
        for p in spares:
            try:
                assert p.stdin is not None
                p.stdin.close()  # an idle spare reads EOF and exits
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
        for p in spares:
            try:
                os.waitpid(p.pid, 0)
            except ChildProcessError:
                pass  # already reaped by the reaper thread
