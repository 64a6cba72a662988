"""The node agent: hosts the job's store (on node 0), spawns the workers of its node,
watches them and restarts them.

Detection without polling: a thread per worker blocks in ``waitid(WEXITED | WSTOPPED)``,
so the kernel tells the agent the moment a worker exits, is killed or is stopped
(SIGSTOP), and a thread traces each worker's exit sentinel, which reports a death before
the kernel has freed the worker's memory (:mod:`fastft.launch.exit_trace`);
the agent publishes ``ProcessExited`` / ``HangSuspected(stopped=True)`` on the error bus at
once, kills a stopped worker, and restarts dead ones (a new incarnation, Fault1: it heals
from a live peer). A worker that is alive but makes no progress (a GIL-holding loop, a
deadlock) stops writing its heartbeat; after ``hang_timeout`` the agent publishes
``HangSuspected`` and kills it. SIGINT/SIGTERM are forwarded so the job stops cleanly,
and every worker gets ``PR_SET_PDEATHSIG`` so that none outlives a killed agent.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastft.bus import BusConfig, connect_store, host_store, tcpstore_bus
from fastft.errors import ConfigError
from fastft.launch.exit_trace import ExitTracer
from fastft.launch.spare import (
    CUDA_DEVICE,
    DEFAULT_PREFAULT_MB,
    PREFAULT_MB,
    READY_FD,
    order_line,
)
from fastft.protocol import (
    NO_RANK,
    Fault,
    HangSuspected,
    JobKeys,
    Message,
    ProcessExited,
    Role,
    Severity,
)
from fastft.runtime.contract import ENV, SPARE_RUN_AHEAD, STACKS_SIGNAL
from fastft.runtime.events import EventLog
from fastft.runtime.malloc import PREFAULT_MAX
from fastft.runtime.worker import read_heartbeat

__all__ = ["Agent", "LaunchConfig"]

PREFAULT_MAX_MB = PREFAULT_MAX >> 20

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchConfig:
    """``fastft run`` flags. ``command``: the worker command line."""

    command: tuple[str, ...]
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    store: str | None = None
    job: str = "job"
    max_restarts: int = 3
    inject: str | None = None
    hang_timeout_s: float = 30.0
    adaptive_hang: bool = False
    """Scale the hang timeout to the workers' observed steps: ``HANG_GAPS`` times the
    longest recent gap between heartbeats, at least ``HANG_FLOOR_S``, at most
    ``hang_timeout_s`` (which also applies until a worker committed its first step)."""
    start_grace_s: float = 120.0
    store_wait_s: float = 60.0
    min_replicas: int | None = None
    run_dir: str | None = None
    seed: int = 0
    check_every: int = 0
    warm_spares: int = 0
    torchft: str | None = None
    """``fastft``: every worker is a torchft replica (ManagerFFT) and node 0 starts a
    :class:`BusLighthouse`; ``plain``: torchft's own lighthouse and torchft's own failure
    handling (only exits are restarted; for baselines)."""
    lighthouse_heartbeat_ms: int = 5000
    lighthouse_join_ms: int = 60000
    exit_trace: bool = True
    """Trace each worker's exit sentinel (:mod:`fastft.launch.exit_trace`): a death is
    published before the kernel frees the worker's memory (~15-50 ms sooner). Off: a
    debugger or a blocking ``py-spy`` can attach to the workers."""
    keep_gradients: bool = True
    """Elastic world: workers keep each step's weighted local gradient (``RuntimeConfig``)."""
    spare_cuda: bool = True
    """Warm spares on a GPU machine create a CUDA context on the GPU of the worker they are
    likely to replace (``--no-spare-cuda``: not, e.g. for a job that trains on the CPU)."""
    spare_prefault_mb: int = DEFAULT_PREFAULT_MB
    """MiB of heap memory each warm spare touches while it waits, so that the worker it
    becomes does not fault in its model and the state it heals on the recovery path
    (:func:`fastft.runtime.malloc.prefault`). 0 (the default): none; the spare's idle RSS
    grows by that much and it is ready later."""
    spare_run_ahead: bool = False
    """Warm spares run the script up to its ``fastft.init()`` (or ``ManagerFFT``) before
    they are needed, so that what it does before (the model, the optimizer) is off the
    recovery path. The script must not need its rank before ``fastft.init()``."""
    backend: str = "auto"
    """Process groups: ``gloo``, ``nccl`` (one GPU per worker) or ``auto`` (each worker
    picks from where its model lives: :func:`fastft.runtime.contract.choose_backend`)."""
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no worker command: fastft run [flags] script.py [args]")
        if self.nproc < 1:
            raise ConfigError(f"--nproc {self.nproc}: must be >= 1")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"--backend {self.backend!r}: use auto, gloo or nccl")
        if self.backend == "nccl":  # the workers' own rule, checked before they start
            import torch

            from fastft.runtime.contract import choose_backend

            gpus = torch.cuda.device_count()  # no CUDA context in the agent
            choose_backend("nccl", {"cuda"}, local_world=self.nproc, gpus=gpus)
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} with --nnodes {self.nnodes}: "
                "node rank must be in 0..nnodes-1"
            )
        if self.nnodes > 1 and not self.store:
            raise ConfigError("--nnodes > 1 needs --store HOST:PORT (node 0 hosts it)")
        if self.store is not None:
            host, _, port = self.store.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--store {self.store!r}: expected HOST:PORT")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts must be >= 0")
        if self.hang_timeout_s <= 0:
            raise ConfigError("--hang-timeout must be > 0 seconds")
        world = self.nproc * self.nnodes
        if self.min_replicas is not None and not 1 <= self.min_replicas <= world:
            raise ConfigError(f"--min-replicas {self.min_replicas}: must be in 1..{world}")
        if not 0 <= self.warm_spares <= self.nproc:
            raise ConfigError(f"--warm-spares {self.warm_spares}: use 0..{self.nproc}")
        if not 0 <= self.spare_prefault_mb <= PREFAULT_MAX_MB:
            raise ConfigError(
                f"--spare-prefault-mb {self.spare_prefault_mb}: use 0..{PREFAULT_MAX_MB} "
                "(memory kept mapped above glibc's trim threshold would be returned)"
            )
        if self.warm_spares and (
            len(self.command) < 2
            or os.path.basename(self.command[0]) != os.path.basename(sys.executable)
        ):
            raise ConfigError(
                "--warm-spares needs a Python worker (script.py or -m module), "
                f"not {self.command[0]!r}"
            )
        if self.spare_run_ahead and not self.warm_spares:
            raise ConfigError("--spare-run-ahead needs warm spares: add --warm-spares N")
        if self.inject is not None:
            from fastft.inject import FaultPlan

            FaultPlan.load(self.inject)  # fails now, with the plan's own message
        if self.torchft not in (None, "fastft", "plain"):
            raise ConfigError(f"--torchft {self.torchft!r}: use fastft or plain")
        if self.torchft is not None:
            if self.lighthouse_heartbeat_ms < 1 or self.lighthouse_join_ms < 1:
                raise ConfigError("--lighthouse-heartbeat-ms and --lighthouse-join-ms must be >= 1")
            try:
                import torchft  # noqa: F401

                if self.torchft == "fastft":
                    import grpc  # noqa: F401  (BusLighthouse)
            except ImportError as e:
                raise ConfigError(
                    f"--torchft needs torchft: pip install 'fastft[torchft]' ({e})"
                ) from e
        if "/" in self.job or not self.job:
            raise ConfigError(f"--job {self.job!r}: non-empty, without '/'")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


@dataclass
class _Slot:
    rank: int
    life: int = 0
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    heartbeat: str = ""
    done: bool = False
    hung: int = 0
    """The incarnation last reported hung (killed; not reported twice)."""
    stopped: int = 0
    """The incarnation last reported stopped."""


HANG_GAPS = 20.0
HANG_FLOOR_S = 2.0
COLD_RESTART_DELAY_S = 0.05
"""In an elastic world, how long a cold restart waits after the exit (see _after_exit)."""
SPARE_REFILL_MAX_S = 2.0
"""A spare handed out is replaced once the worker it became has committed, or after this
long: a new spare's imports (~1 s of CPU) would compete with the recovery it is part of."""


class Agent:
    """One per node. :meth:`run` blocks until the job ends and returns the exit code."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="fastft-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir, f"agent {config.node_rank}")
        self.keys = JobKeys(config.job)
        self._server = None
        if config.node_rank == 0 and (config.store is None or _is_local(config.store)):
            port = int(config.store.rpartition(":")[2]) if config.store else 0
            host = "127.0.0.1" if config.store is None else config.store.rpartition(":")[0]
            self._server = host_store(host, port)
            self.store_addr = f"127.0.0.1:{self._server.port}"
        else:
            assert config.store is not None
            self.store_addr = config.store
        self.store = connect_store(self.store_addr, wait_s=config.store_wait_s)
        self.bus = tcpstore_bus(
            self.store,
            BusConfig(
                job=config.job, rank=NO_RANK, incarnation=secrets.randbits(62) | 1, role=Role.AGENT
            ),
        )
        first = config.node_rank * config.nproc
        self.slots = {r: _Slot(r) for r in range(first, first + config.nproc)}
        self._by_pid: dict[int, _Slot] = {}
        self._spares: list[subprocess.Popen[bytes]] = []
        self._spare_gpu: dict[int, int] = {}
        """pid -> the GPU a spare warmed (only where there are GPUs and spare_cuda)."""
        self._gpus = 0
        if config.warm_spares and config.spare_cuda:
            import torch

            self._gpus = torch.cuda.device_count()
        self._dead_spares: set[int] = set()
        self._ready_spares: set[int] = set()
        """pids of spares that said they are warm (:meth:`_await_ready`)."""
        self._restarts_due: list[tuple[float, _Slot]] = []
        """Slots to restart, spawned by the main thread: a child's PR_SET_PDEATHSIG fires
        when the *thread* that forked it ends, and the threads that see exits are short-lived."""
        self._spares_owed: list[tuple[float, _Slot, int]] = []
        """(deadline, slot, incarnation) of each spare handed out and not yet replaced."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping: int | None = None
        self._failed: str | None = None
        self.restarts = 0
        self.tracer = ExitTracer()
        self.lighthouse: Any = None
        self.lighthouse_addr = ""

    # --- lifecycle -------------------------------------------------------------------------
    def run(self) -> int:
        prev = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.bus.subscribe(self._on_message)
        self.bus.start()
        self.events.emit(
            "agent_start",
            store=self.store_addr,
            nproc=self.config.nproc,
            node_rank=self.config.node_rank,
            world_size=self.config.world_size,
            pid=os.getpid(),
        )
        print(
            f"fastft: job {self.config.job}, store {self.store_addr}, run dir {self.run_dir}",
            file=sys.stderr,
            flush=True,
        )
        try:
            self._start_lighthouse()
            for slot in self.slots.values():
                self._spawn(slot)
            for i in range(self.config.warm_spares):
                self._start_spare(self._gpu_of(i))
            self._watch()
            code = self._finish()
        finally:
            self._stop_spares()
            self._kill_all(signal.SIGKILL, grace_s=0)
            if isinstance(self.lighthouse, subprocess.Popen):
                self.lighthouse.terminate()
                try:
                    self.lighthouse.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.lighthouse.kill()
                    self.lighthouse.wait()
            elif self.lighthouse is not None:
                self.lighthouse.shutdown()
            for s, h in prev.items():
                signal.signal(s, h)
            self.bus.close()
            self.events.emit("agent_stop", restarts=self.restarts, failed=self._failed)
            self.events.close()
        return code

    def _finish(self) -> int:
        if self._stopping is not None:
            return 128 + self._stopping
        if self._failed:
            print(f"fastft: job failed: {self._failed}", file=sys.stderr, flush=True)
            return 1
        # Node 0 hosts the store: it waits until every other node's agent is done.
        self.store.add(f"{self.keys.root}/agents_done", 1)
        if self._server is not None and self.config.nnodes > 1:
            deadline = time.monotonic() + 60
            while int(self.store.add(f"{self.keys.root}/agents_done", 0)) < self.config.nnodes:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        return 0

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stopping is None:
            self._stopping = signum
            self._wake.set()

    # --- workers ---------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        cfg = self.config
        slot.incarnation = secrets.randbits(62) | 1
        slot.heartbeat = str(self.run_dir / f".heartbeat-{slot.rank}")
        env = {
            **os.environ,
            **cfg.env,
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
            ENV["store"]: self.store_addr,
            ENV["job"]: cfg.job,
            ENV["rank"]: str(slot.rank),
            ENV["world_size"]: str(cfg.world_size),
            ENV["life"]: str(slot.life),
            ENV["run_dir"]: str(self.run_dir),
            ENV["heartbeat"]: slot.heartbeat,
            ENV["incarnation"]: str(slot.incarnation),
            ENV["seed"]: str(cfg.seed),
            ENV["check_every"]: str(cfg.check_every),
            ENV["keep_gradients"]: "1" if cfg.keep_gradients else "0",
            ENV["backend"]: cfg.backend,
            # torchrun's names: scripts place their model on cuda:LOCAL_RANK
            "LOCAL_RANK": str(self._local(slot)),
            "LOCAL_WORLD_SIZE": str(cfg.nproc),
        }
        trace_path = str(self.run_dir / f".exit-trace-{slot.rank}-{slot.life}")
        if cfg.exit_trace and self.tracer.refused is None:
            env[ENV["exit_trace"]] = trace_path
        if cfg.min_replicas is not None:
            env[ENV["min_replicas"]] = str(cfg.min_replicas)
        if cfg.torchft:
            env["TORCHFT_LIGHTHOUSE"] = self.lighthouse_addr
            env["REPLICA_GROUP_ID"] = str(slot.rank)
            env["NUM_REPLICA_GROUPS"] = str(cfg.world_size)
            env.setdefault("RUST_LOG", "warn")  # torchft's per-step INFO logs halve a small step
        if cfg.inject:
            env[ENV["inject"]] = str(Path(cfg.inject).resolve())
        try:
            os.unlink(slot.heartbeat)
        except FileNotFoundError:
            pass
        taken = self._take_spare(self._gpu_of(self._local(slot))) if slot.life > 0 else None
        spare, ready = taken if taken is not None else (None, False)
        if spare is not None:
            try:
                assert spare.stdin is not None
                spare.stdin.write(order_line(env, list(cfg.command)))
                spare.stdin.close()
            except OSError:  # it died before it was needed: start the worker cold
                log.warning("warm spare %d is gone; starting rank %d cold", spare.pid, slot.rank)
                spare = None
        with self._lock:
            if spare is not None:
                slot.proc = spare
            else:
                slot.proc = subprocess.Popen(
                    list(cfg.command), env=env, preexec_fn=_die_with_parent
                )
            slot.started = time.monotonic()
            self._by_pid[slot.proc.pid] = slot
        if spare is None:
            self._reap(slot.proc.pid)
        if ENV["exit_trace"] in env:
            self._trace_exit(slot, slot.proc.pid, trace_path)
        self._wake.set()
        self.events.emit(
            "spawn",
            rank=slot.rank,
            life=slot.life,
            pid=slot.proc.pid,
            incarnation=slot.incarnation,
            warm=spare is not None,
            **({"spare_ready": ready} if spare is not None else {}),
        )
        if spare is not None:  # the next failure gets one too, once this one recovered
            with self._lock:
                self._spares_owed.append(
                    (time.monotonic() + SPARE_REFILL_MAX_S, slot, slot.incarnation)
                )

    def _trace_exit(self, slot: _Slot, pid: int, path: str) -> None:
        """Hear of this worker's death as it starts (:mod:`fastft.launch.exit_trace`)."""
        claimed = [False]

        def report(code: int | None, sig: int | None, t: float) -> None:
            claimed[0] = self._claim_exit(slot, pid, code, sig, t, "exit_trace")

        def after(code: int | None, sig: int | None, t: float) -> None:
            if claimed[0]:
                self._after_exit(slot, code, sig)

        def stopped(t: float) -> None:
            with self._lock:
                mine = self._by_pid.get(pid) is slot
            if mine:
                self._on_stopped(slot, t, "exit_trace")

        self.tracer.watch(pid, path, lambda: pid in self._by_pid, report, after, stopped)

    # --- warm spares -----------------------------------------------------------------------
    def _local(self, slot: _Slot) -> int:
        """The slot's rank on this node (``LOCAL_RANK``)."""
        return slot.rank - self.config.node_rank * self.config.nproc

    def _gpu_of(self, local_rank: int) -> int | None:
        """The GPU a worker of this local rank trains on, by torchrun's convention (the
        demo's too): ``cuda:LOCAL_RANK`` modulo the GPUs visible; None when spares warm
        no GPU."""
        return local_rank % self._gpus if self._gpus else None

    def _start_spare(self, gpu: int | None = None) -> None:
        if self._stopping is not None or self._failed:
            return
        env = {**os.environ, **self.config.env}
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        if gpu is not None:
            env[CUDA_DEVICE] = str(gpu)
        env[PREFAULT_MB] = str(self.config.spare_prefault_mb)
        if self.config.spare_run_ahead:
            env[SPARE_RUN_AHEAD] = json.dumps(list(self.config.command))
        ready_r, ready_w = os.pipe()
        env[READY_FD] = str(ready_w)
        t0 = time.monotonic()
        try:
            p = subprocess.Popen(
                # not `-m fastft.launch.spare`: the package imports that module first, and
                # runpy warns that it runs a module already in sys.modules
                [self.config.command[0], "-c", "from fastft.launch.spare import main; main()"],
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=(ready_w,),
                preexec_fn=_die_with_parent,
            )
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        with self._lock:
            self._spares.append(p)
            if gpu is not None:
                self._spare_gpu[p.pid] = gpu
        self._reap(p.pid)
        threading.Thread(
            target=self._await_ready,
            args=(p.pid, ready_r, t0),
            name=f"fastft-spare-ready-{p.pid}",
            daemon=True,
        ).start()
        self.events.emit("spare_start", pid=p.pid, gpu=gpu)

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
        with self._lock:
            self._ready_spares.add(pid)
        self.events.emit("spare_ready", pid=pid, warm_up_ms=round((time.monotonic() - t0) * 1e3, 1))

    def _idle_spare_exited(self, info: os.waitid_result) -> None:
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

    def _refill_spares(self, now: float) -> None:
        """Start the spares owed whose worker committed (its heartbeat tracks step gaps
        from its first commit on), died again, or waited ``SPARE_REFILL_MAX_S``."""
        with self._lock:
            owed, self._spares_owed = self._spares_owed, []
        keep = []
        for deadline, slot, inc in owed:
            hb = read_heartbeat(slot.heartbeat) if slot.incarnation == inc else None
            committed = hb is not None and hb[0] >= slot.started and hb[1] > 0
            if now >= deadline or slot.incarnation != inc or slot.done or committed:
                self._start_spare(self._gpu_of(self._local(slot)))
            else:
                keep.append((deadline, slot, inc))
        with self._lock:
            self._spares_owed = keep + self._spares_owed

    def _take_spare(self, gpu: int | None = None) -> tuple[subprocess.Popen[bytes], bool] | None:
        """A live spare and whether it was ready: one that warmed ``gpu`` if there is one
        (a CUDA context costs ~0.4 s), else a ready one (a spare still warming up has up
        to its imports left), else the oldest."""
        with self._lock:
            self._spares = [p for p in self._spares if p.pid not in self._dead_spares]
            if not self._spares:
                return None
            p = max(
                self._spares,
                key=lambda p: (self._spare_gpu.get(p.pid) == gpu, p.pid in self._ready_spares),
            )
            self._spares.remove(p)
            self._spare_gpu.pop(p.pid, None)
            ready = p.pid in self._ready_spares
            self._ready_spares.discard(p.pid)
            return p, ready

    def _stop_spares(self) -> None:
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

    def _reap(self, pid: int) -> None:
        """Start the thread that blocks in ``waitid`` for child ``pid``: the kernel reports
        its exit or stop the moment it happens. One thread per child, each waiting for its
        own pid: a ``waitid(P_ALL)`` would also take the exit-trace stops of the traced
        sentinel threads (a tracer's whole thread group may wait for its tracees)."""
        threading.Thread(
            target=self._reap_loop, args=(pid,), name=f"fastft-reaper-{pid}", daemon=True
        ).start()

    def _reap_loop(self, pid: int) -> None:
        while True:
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WSTOPPED)
            except ChildProcessError:
                return  # reaped elsewhere (_stop_spares)
            except InterruptedError:
                continue
            if info is None:
                continue
            t = time.monotonic()
            with self._lock:
                slot = self._by_pid.get(info.si_pid)
                idle_spare = slot is None and any(p.pid == info.si_pid for p in self._spares)
                if idle_spare:
                    self._dead_spares.add(info.si_pid)  # never hand out a dead spare
            stopped = info.si_code == os.CLD_STOPPED
            if slot is None:  # a spare, or an exit the exit trace already reported
                if stopped:
                    continue
                if idle_spare and self._stopping is None:
                    self._idle_spare_exited(info)
                return
            if stopped:
                self._on_stopped(slot, t, "waitid")
            elif info.si_code in (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED):
                code = info.si_status if info.si_code == os.CLD_EXITED else None
                sig = info.si_status if info.si_code != os.CLD_EXITED else None
                self._on_exit(slot, info.si_pid, code, sig, t, "waitid")
            if not stopped:
                return

    def _on_stopped(self, slot: _Slot, t: float, via: str) -> None:
        with self._lock:  # the exit trace and waitid may both see it
            if slot.stopped == slot.incarnation:
                return
            slot.stopped = slot.incarnation
        self.events.emit(
            "worker_stopped", rank=slot.rank, incarnation=slot.incarnation, detected=t, via=via
        )
        if self.config.torchft == "plain":
            slot.hung = slot.incarnation  # torchft's baseline: left to torchft's timeouts
            return
        self._publish(
            HangSuspected(
                **self._hdr,
                hung_rank=slot.rank,
                hung_incarnation=slot.incarnation,
                silent_for_s=0.0,
                stopped=True,
            )
        )
        self._kill(slot)

    def _on_exit(
        self, slot: _Slot, pid: int, code: int | None, sig: int | None, t: float, via: str
    ) -> None:
        if self._claim_exit(slot, pid, code, sig, t, via):
            self._after_exit(slot, code, sig)

    def _claim_exit(
        self, slot: _Slot, pid: int, code: int | None, sig: int | None, t: float, via: str
    ) -> bool:
        """Report the exit of ``pid`` once (the exit trace usually sees it first, waitid
        later); False if it was reported already."""
        with self._lock:
            if self._by_pid.pop(pid, None) is None:
                return False
        assert slot.proc is not None and slot.proc.pid == pid
        slot.proc.returncode = code if code is not None else -(sig or 0)
        self.events.emit(
            "worker_exit",
            rank=slot.rank,
            incarnation=slot.incarnation,
            exit_code=code,
            signal=sig,
            life=slot.life,
            detected=t,
            via=via,
        )
        self._publish(
            ProcessExited(
                **self._hdr,
                exited_rank=slot.rank,
                exited_incarnation=slot.incarnation,
                exit_code=code,
                signal=sig,
            )
        )
        return True

    def _after_exit(self, slot: _Slot, code: int | None, sig: int | None) -> None:
        self._forget_joiner(slot)
        if code == 0 or self._stopping is not None or slot.done:
            slot.done = True  # (done already: a stopped torchft baseline ended by _end_stopped)
        elif any(
            s.done and s.proc is not None and s.proc.returncode == 0 for s in self.slots.values()
        ):
            # Peers already finished the job: there is nothing left to rejoin.
            self._failed = (
                f"rank {slot.rank} failed ({code=}, {sig=}) after other workers "
                "had finished the job"
            )
            slot.done = True
        elif slot.life < self.config.max_restarts:
            slot.life += 1
            self.restarts += 1
            self.events.emit("restart", rank=slot.rank, life=slot.life)
            # A cold start forks the agent (tens of MB of page tables, ~15 ms here), which
            # slows the store it hosts while the survivors re-form through it. An elastic
            # world does not wait for the restart: give the survivors a head start.
            cold = not self._spares
            delay = COLD_RESTART_DELAY_S if cold and self._elastic else 0.0
            with self._lock:
                self._restarts_due.append((time.monotonic() + delay, slot))
        else:
            self._failed = (
                f"rank {slot.rank} failed ({'code ' + str(code) if sig is None else 'signal ' + str(sig)}) "
                f"and has no restarts left (--max-restarts {self.config.max_restarts})"
            )
            slot.done = True
        self._wake.set()

    def _forget_joiner(self, slot: _Slot) -> None:
        key = self.keys.joiner(slot.rank)
        try:
            # Joiner keys are cleared, never deleted: a worker may be between its check
            # and its get of the key, and a get of a missing key blocks for the timeout.
            self.store.compare_set(key, str(slot.incarnation), "")
        except Exception:  # noqa: BLE001 - best effort
            log.debug("could not clear joiner key of rank %d", slot.rank, exc_info=True)

    def _watch(self) -> None:
        """Main loop: hang detection and the end of the job."""
        period = min(0.02, self.config.hang_timeout_s / 10)  # a hang is seen within 20 ms
        while True:
            self._wake.wait(period)
            self._wake.clear()
            if self._stopping is not None:
                self.events.emit("stop", signal=self._stopping)
                self._kill_all(signal.SIGTERM, grace_s=5.0)
                return
            if self._failed:
                self._kill_all(signal.SIGTERM, grace_s=2.0)
                return
            if self._all_done():
                return
            now = time.monotonic()
            with self._lock:
                due = [s for t, s in self._restarts_due if t <= now]
                self._restarts_due = [(t, s) for t, s in self._restarts_due if t > now]
            for slot in due:
                self._spawn(slot)
            if self._spares_owed:
                self._refill_spares(time.monotonic())
            if self.config.torchft == "plain":
                self._end_stopped()
                continue  # no heartbeats: torchft's own timeouts handle hangs
            now = time.monotonic()
            for slot in list(self.slots.values()):
                self._check_hang(slot, now)

    def _check_hang(self, slot: _Slot, now: float) -> None:
        if slot.done or slot.proc is None or slot.proc.returncode is not None:
            return
        if slot.hung == slot.incarnation:
            return  # reported and killed; its exit is on the way
        hb = read_heartbeat(slot.heartbeat)
        beat, gap = hb if hb is not None else (None, 0.0)
        if beat is None or beat < slot.started:
            if now - slot.started > self.config.start_grace_s:
                beat = slot.started
            else:
                return  # still starting (imports): no heartbeat yet
        silent = now - beat
        timeout = self.config.hang_timeout_s
        if self.config.adaptive_hang and gap > 0:
            timeout = min(timeout, max(HANG_FLOOR_S, HANG_GAPS * gap))
        if silent > timeout:
            self.events.emit(
                "worker_hung",
                rank=slot.rank,
                incarnation=slot.incarnation,
                silent_s=round(silent, 3),
                timeout_s=round(timeout, 3),
                detected=now,
            )
            self._publish(
                HangSuspected(
                    **self._hdr,
                    hung_rank=slot.rank,
                    hung_incarnation=slot.incarnation,
                    silent_for_s=round(silent, 3),
                    stopped=False,
                )
            )
            inc = slot.incarnation
            slot.hung = inc  # reported once, even if the exit takes a while to be seen
            self._kill(slot, STACKS_SIGNAL, incarnation=inc)  # it prints its stacks
            if slot.proc is not None:
                await_signal_taken(slot.proc.pid, STACKS_SIGNAL)
            self._kill(slot, incarnation=inc)  # never the restarted life in the slot

    def _on_message(self, m: Message) -> None:
        # A worker declared silent by its peers: kill it if it is one of ours (restart).
        if isinstance(m, Fault) and m.severity is Severity.FAULT1 and m.rank != m.faulty_rank:
            slot = self.slots.get(m.faulty_rank)
            if slot and slot.incarnation == m.faulty_incarnation and not slot.done:
                self.events.emit("kill_declared_dead", rank=slot.rank, cause=m.cause)
                self._kill(slot)

    def _kill(self, slot: _Slot, sig: int = signal.SIGKILL, incarnation: int | None = None) -> None:
        with self._lock:
            p = slot.proc
            if p is None or p.returncode is not None or p.pid not in self._by_pid:
                return
            if incarnation is not None and slot.incarnation != incarnation:
                return  # the slot holds a newer life by now
            try:
                os.kill(p.pid, sig)
                if sig != signal.SIGKILL:
                    os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _kill_all(self, sig: int, grace_s: float) -> None:
        for slot in self.slots.values():
            slot.done = True
            self._kill(slot, sig)
        deadline = time.monotonic() + grace_s
        while self._by_pid and time.monotonic() < deadline:
            time.sleep(0.02)
        for slot in self.slots.values():
            self._kill(slot, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self._by_pid and time.monotonic() < deadline:
            time.sleep(0.01)

    def _end_stopped(self) -> None:
        """torchft's baseline leaves a stopped worker stopped; once every other worker
        finished, end it so that the job ends."""
        live = [s for s in self.slots.values() if not s.done]
        if live and all(s.hung == s.incarnation for s in live):
            for s in live:
                s.done = True
                self._kill(s, incarnation=s.incarnation)

    def _start_lighthouse(self) -> None:
        """torchft's lighthouse for ``--torchft``: on node 0, in a process of its own
        (``fastft``: :class:`BusLighthouse`, a bus subscriber) or in the agent
        (``plain``: torchft's own); other nodes read its address from the store."""
        cfg = self.config
        if cfg.torchft is None:
            return
        from fastft.integrations.torchft.lighthouse import lighthouse_key

        key = lighthouse_key(cfg.job)
        if cfg.node_rank != 0:
            self.lighthouse_addr = self.store.get(key).decode()
            return
        local = self.store_addr.startswith("127.0.0.1:")
        host = "127.0.0.1" if local else "0.0.0.0"
        adv = "127.0.0.1" if local else socket.gethostname()
        if cfg.torchft == "plain":
            os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO
            from torchft._torchft import LighthouseServer

            self.lighthouse = LighthouseServer(
                bind=f"{host}:0",
                min_replicas=cfg.min_replicas or 1,
                join_timeout_ms=cfg.lighthouse_join_ms,
                heartbeat_timeout_ms=cfg.lighthouse_heartbeat_ms,
            )
            port = int(self.lighthouse.address().rpartition(":")[2])
            self.store.set(key, f"http://{adv}:{port}")
        else:
            self.lighthouse = subprocess.Popen(
                [
                    sys.executable,
                    "-c",  # not -m: the package imports the module first (runpy warns)
                    "import sys; from fastft.integrations.torchft.lighthouse import main; "
                    "sys.exit(main())",
                    f"--store={self.store_addr}",
                    f"--job={cfg.job}",
                    f"--bind={host}:0",
                    f"--advertise={adv}",
                    f"--min-replicas={cfg.min_replicas or 1}",
                    f"--heartbeat-ms={cfg.lighthouse_heartbeat_ms}",
                    f"--join-ms={cfg.lighthouse_join_ms}",
                    # the first quorum waits for every replica started (slow imports vary)
                    f"--first-quorum={cfg.world_size}",
                    f"--run-dir={self.run_dir}",
                ],
                preexec_fn=_die_with_parent,
            )
            deadline = time.monotonic() + self.config.store_wait_s
            while not self.store.check([key]):
                if self.lighthouse.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the torchft lighthouse did not start (exit code "
                        f"{self.lighthouse.returncode}); its error is above"
                    )
                time.sleep(0.01)
        self.lighthouse_addr = self.store.get(key).decode()
        self.events.emit("lighthouse_ready", kind=cfg.torchft, address=self.lighthouse_addr)

    @property
    def _elastic(self) -> bool:
        cfg = self.config
        return cfg.min_replicas is not None and cfg.min_replicas < cfg.world_size

    def _all_done(self) -> bool:
        return all(s.done for s in self.slots.values())

    @property
    def _hdr(self) -> dict[str, Any]:
        """The header of what the agent publishes: no rank, no epoch of its own."""
        return dict(job=self.config.job, epoch=0, rank=NO_RANK, incarnation=0, role=Role.AGENT)

    def _publish(self, msg: Message) -> None:
        try:
            self.bus.broadcast(msg)
        except Exception:  # noqa: BLE001 - the bus must not take the agent down
            log.exception("agent: could not publish %s", type(msg).__name__)


STACKS_MAX_S = 0.05
"""The most a hung worker is given to print its stacks before it is killed."""
STACKS_WRITE_S = 0.003
"""After it took the signal: faulthandler's C handler writes every thread's stack (a few
writes, well under a ms here)."""


def await_signal_taken(pid: int, sig: int, max_s: float = STACKS_MAX_S) -> bool:
    """Wait until ``pid`` has taken ``sig`` (it is no longer pending in
    ``/proc/PID/status``), then ``STACKS_WRITE_S`` for its handler to write; at most
    ``max_s`` in all. A fixed wait of ``max_s`` was on the recovery path of every hang in
    a fixed world (its replacement starts at its exit); the handler runs 0.2-12 ms after
    the signal on this loaded 2-core machine. Returns whether it was seen taken."""
    bit = 1 << (sig - 1)
    deadline = time.monotonic() + max_s
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            return False  # gone
        pending = 0
        for line in status.splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                pending |= int(line.split()[1], 16)
        left = deadline - time.monotonic()
        if not pending & bit:
            time.sleep(max(0.0, min(STACKS_WRITE_S, left)))
            return True
        if left <= 0:
            return False
        time.sleep(min(0.0005, left))


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the agent dies (no orphans)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _is_local(addr: str) -> bool:
    host = addr.rpartition(":")[0]
    return host in ("127.0.0.1", "localhost", "0.0.0.0", "::1")
