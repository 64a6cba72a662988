"""The node agent: hosts the job's store (on node 0), spawns the workers of its node,
watches them and restarts them.

The agent publishes ``ProcessExited`` / ``HangSuspected(stopped=True)`` on the error bus the
moment its children (:mod:`fastft.launch.procs.children`) see an exit or a stop, kills a stopped
worker, and restarts dead ones (a new incarnation, Fault1: it heals from a live peer). A
worker that is alive but makes no progress (a GIL-holding loop, a deadlock) stops writing
its heartbeat; after the hang timeout the agent publishes ``HangSuspected`` and kills it.
What to do is decided by :mod:`fastft.launch.rules.policy`; this loop does it. SIGINT/SIGTERM
are forwarded so the job stops cleanly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fastft.errors import BusClosed
from fastft.inject.plan import planned
from fastft.launch.control import ControlPlane, first_lives_base
from fastft.launch.exits import Exits, back_line
from fastft.launch.gray.stragglers import Stragglers
from fastft.launch.gray.verdicts import Verdicts, warn_unfired
from fastft.launch.nodes.nodewatch import NodeWatch
from fastft.launch.nodes.voice import AgentVoice
from fastft.launch.procs.children import Children, Slot, die_with_parent
from fastft.launch.procs.output import Output
from fastft.launch.procs.spares import SparePool
from fastft.launch.procs.standby import Warm, node_zygote
from fastft.launch.rules import policy
from fastft.launch.rules.ledger import Ledger
from fastft.launch.rules.offenders import Offenders
from fastft.launch.settings.config import LaunchConfig
from fastft.launch.settings.workerenv import start_lines
from fastft.launch.spawn import Spawner
from fastft.process.beat import read_heartbeat
from fastft.process.events import EventLog
from fastft.process.rundir import default_run_dir
from fastft.protocol import (
    NO_RANK,
    JobKeys,
    Message,
    Role,
)
from fastft.protocol.exits import JOB_INTERRUPTED, JOB_PREEMPTED

__all__ = ["Agent", "LaunchConfig"]

log = logging.getLogger(__name__)

DONE_WAIT_S = 60.0
"""How long the store's node waits, at the job's end, for the other agents to finish."""
FAILED_WAIT_S = 10.0
"""... and after a failure, for the others to hear of it (each within a lease round)."""


class Agent:
    """One per node. :meth:`run` blocks until the job ends and returns the exit code."""

    def __init__(self, config: LaunchConfig, warm: Warm | None = None) -> None:
        self.config, self.warm = config, warm  # (warm: --standby's zygote and output)
        self.run_dir = Path(config.run_dir or default_run_dir(config.job))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir, f"agent {config.node_rank}")
        self.keys = JobKeys(config.job)
        plane = ControlPlane.open(config, self.run_dir, self.keys)
        self._server, self.bound = plane.server, plane.bound
        self.store_addr, self.secret_file = plane.address, plane.secret_file
        self.store, self.bus, self.started = plane.store, plane.bus, plane.started
        self.hub = plane.hub
        self.voice = (
            AgentVoice(self.hub, self.store, self.keys, self._running) if self.hub else None
        )
        """The node's voice (:mod:`.nodes.voice`): its workers' arrivals at a formation
        written together, and the closed epoch waited for once (with the relay)."""
        self.spawner = Spawner(self, plane)
        """Starts the workers' lives (:mod:`.spawn`)."""
        first = config.node_rank * config.nproc
        self.slots = {r: Slot(r) for r in range(first, first + config.nproc)}
        self.exits = Exits(self)
        self.nodes = NodeWatch(self)
        self.verdicts = Verdicts(self)
        self.stragglers = Stragglers(self)
        self.offenders = Offenders(config.quarantine_rule)
        self.children = Children(
            on_stopped=self.exits.on_stopped,
            claim=self.exits.claim_exit,
            after_exit=self.exits.after_exit,
            on_other=self.exits.on_other_exit,
            output=warm.output if warm else Output(config.log_dir, config.tee),
        )
        gpus = 0
        if config.warm_spares and config.spare_cuda:
            import torch

            gpus = torch.cuda.device_count()  # no CUDA context in the agent
        self.spares = SparePool(
            config,
            self.events,
            reap=self.children.reap,
            preexec=die_with_parent,
            gpus=gpus,
            output=self.children.output,
        )
        self._restarts_due: list[tuple[float, Slot]] = []
        """Slots to restart, spawned by the main thread: a child's PR_SET_PDEATHSIG fires
        when the *thread* that forked it ends, and the threads that see exits are short-lived."""
        self._wake = threading.Event()
        self.stopping: int | None = None
        self.draining: float | None = None
        """When the agent drains its workers (a SIGTERM, ``fastft drain --node``): the
        deadline after which it stops them (``--drain-grace``)."""
        self._late: list[str] = []  # (rank.life still running once a drain's grace ran out)
        self._drain_why: str | None = None
        self._drain_sent: set[int] = set()  # (the lives told to drain)
        self.failed: str | None = None
        self.ledger = Ledger(self.slots)
        """What this agent did to its node's lives (:mod:`.ledger`): its parts' one way to
        change it."""
        self.committed = _committed
        self.lighthouse: Any = None
        self.lighthouse_addr = ""

    def run(self) -> int:
        prev = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        for part in (self.verdicts, self.stragglers):
            self.bus.subscribe(part.on_message)
        self.bus.start()
        if self.voice is not None:
            self.voice.start()
        cfg = self.config
        self.events.emit(
            "agent_start",
            store=self.store_addr,
            nproc=cfg.nproc,
            node_rank=cfg.node_rank,
            world_size=cfg.world_size,
            pid=os.getpid(),
            plan=planned(cfg.inject),
        )
        where = f"store {self.bound} (listening)" if self.bound else f"store {self.store_addr}"
        for line in start_lines(cfg, where, self.run_dir, self.secret_file):
            print(line, file=sys.stderr, flush=True)
        metrics = None
        if cfg.metrics_port is not None:
            from fastft.metrics import Exporter

            metrics = Exporter(self.run_dir, cfg.metrics_addr, cfg.metrics_port)
            url = f"http://{cfg.metrics_addr}:{metrics.port}/metrics"
            self.events.emit("metrics", url=url, port=metrics.port)
            print(f"fastft: metrics on {url}", file=sys.stderr, flush=True)
        try:
            self.nodes.start()
            self._start_lighthouse()
            out = self.children.output
            self.children.zygote, why = node_zygote(cfg, self.warm, out, self.events.emit)
            self.spares.zygote = self.children.zygote  # (spares are its forks too)
            first = list(self.slots.values()) if why is None else []
            base = first_lives_base(self.store, self.keys, cfg.node_rank) if first else 0
            for slot in first:  # (the node's first lives: recorded in one write, not one each)
                slot.incarnation = base + slot.rank
            self.nodes.record_lives()
            for slot in first:
                self.spawner.spawn(slot, drawn=True)
            if why is not None:
                self.fail(why)
            for i in range(cfg.warm_spares):
                self._start_spare(self.spares.gpu_of(i))
            self._watch()
            code = self._finish()
            warn_unfired(self.run_dir, set(self.slots), cfg.inject)
        finally:
            if self.nodes.lease is not None:
                self.nodes.lease.close()
            self.spares.stop()
            self.children.kill_all(list(self.slots.values()), signal.SIGKILL, grace_s=0)
            if self.lighthouse is not None:
                import fastft.integrations.torchft.launch as tf

                tf.stop_lighthouse(self.lighthouse)
            for s, h in prev.items():
                signal.signal(s, h)
            if not self.nodes.store_gone:  # (cut off: a call to it never returns)
                self.bus.close()
            if metrics is not None:
                metrics.close()
            relay = dataclasses.asdict(self.hub.stats) if self.hub else None
            if self.voice is not None:
                self.voice.stop()
                assert relay is not None
                relay.update(voice_written=self.voice.written, voice_bad=self.voice.bad)
            self.events.emit(
                "agent_stop", restarts=self.ledger.restarts, failed=self.failed, relay=relay
            )
            self.events.close()
        if self.nodes.store_gone:  # threads wait in calls to a store cut off: leave now
            sys.stderr.flush()
            os._exit(code)
        return code

    def _running(self) -> int:
        """How many of the node's workers run now (the voice's batch waits for them)."""
        return sum(
            1
            for s in self.slots.values()
            if s.proc is not None and not s.done and s.proc.returncode is None
        )

    def _finish(self) -> int:
        self.children.output.flush(timeout_s=2.0)  # (the workers' last lines first)
        finished = any(s.proc is not None and s.proc.returncode == 0 for s in self.slots.values())
        if self.stopping is not None:
            what = policy.stopped_by(self.stopping, self._drain_why, self._late)
            print(
                f"fastft: job stopped ({what}); {policy.resume_hint(self.config.checkpoint_dir)}",
                file=sys.stderr,
                flush=True,
            )
            return JOB_INTERRUPTED if self.stopping == signal.SIGINT else 128 + self.stopping
        if self._drain_why == "SIGTERM" and not finished and not self.failed:
            print(
                "fastft: job preempted (SIGTERM): every worker drained after its last commit; "
                f"{policy.resume_hint(self.config.checkpoint_dir)}",
                file=sys.stderr,
                flush=True,
            )
            self.nodes.finish(None, timeout_s=DONE_WAIT_S)
            return JOB_PREEMPTED
        if self.failed:
            print(f"fastft: job failed: {self.failed}", file=sys.stderr, flush=True)
            self.nodes.finish(self.failed, timeout_s=FAILED_WAIT_S)
            return 1
        # Node 0 hosts the store: it waits until every other node's agent is done or lost.
        self.nodes.finish(None, timeout_s=DONE_WAIT_S)
        return 0

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGTERM and self.draining is None and self.stopping is None:
            self.drain("SIGTERM")  # a preemption notice: leave at the next commit
            return
        if self.stopping is None:  # SIGINT, or a second SIGTERM: stop now
            self.stopping = signum
            self._wake.set()

    def drain(self, why: str) -> None:
        """Drain every worker of this node: each leaves after its next commit (nothing
        is rolled back), none is restarted, and the agent exits once they have left (0;
        :data:`JOB_PREEMPTED` after a SIGTERM, with a line that says how to resume);
        after ``--drain-grace`` seconds it stops those still there."""
        self.draining = time.monotonic() + self.config.drain_grace_s
        self._drain_why = why
        self.events.emit("drain", why=why, grace_s=self.config.drain_grace_s)
        self._wake.set()

    # --- workers ---------------------------------------------------------------------------
    def _start_spare(self, gpu: int | None) -> None:
        if self.stopping is None and not self.failed:
            self.spares.start(gpu)

    def _watch(self) -> None:
        """Main loop: restarts, spares, hang detection and the end of the job."""
        period = min(0.02, self.config.hang_timeout_s / 10)  # a hang is seen within 20 ms
        slots = list(self.slots.values())
        while True:
            self._wake.wait(period)
            self._wake.clear()
            if self.children.zygote is not None:  # (from this thread: see restart_later)
                self.children.zygote.tend()
            if self.draining is not None:
                for slot in slots:  # (each worker's SIGTERM handler asks for its drain)
                    # once its runtime is up (its first heartbeat): before, the handler is
                    # not there yet, and a SIGTERM would end it
                    if (
                        not slot.done
                        and slot.incarnation not in self._drain_sent
                        and read_heartbeat(slot.heartbeat) is not None
                    ):
                        self._drain_sent.add(slot.incarnation)
                        self.children.kill(slot, signal.SIGTERM, incarnation=slot.incarnation)
            late = self.draining is not None and time.monotonic() > self.draining
            if late and not all(s.done for s in slots):
                self._late = [f"{s.rank}.{s.life}" for s in slots if not s.done]
                late_line = policy.drain_late_line(self._late, self.config.drain_grace_s)
                print(late_line, file=sys.stderr, flush=True)
                self.stopping = signal.SIGTERM
            if self.stopping is not None:
                self.events.emit("stop", signal=self.stopping)
                self.children.kill_all(slots, signal.SIGKILL, grace_s=0.0)
                return
            if self.failed:
                self.events.emit("job_failed", reason=self.failed)  # (its kills are no faults)
                self.children.kill_all(slots, signal.SIGKILL, grace_s=0.0)
                return
            if all(s.done for s in slots):
                return
            now = time.monotonic()
            for slot in slots:
                back = slot.fault_at and slot.started > slot.fault_at and not slot.done
                if back and _committed(slot):  # (a later life's first commit)
                    print(back_line(slot, now), file=sys.stderr, flush=True)
                    slot.fault_at = 0.0
            ready = not self.nodes.store_gone  # (no new life while the store is silent)
            with self.children.lock:
                due = [s for t, s in self._restarts_due if ready and t <= now]
                self._restarts_due = [x for x in self._restarts_due if not (ready and x[0] <= now)]
            for slot in due:
                if self.draining is not None:  # (no new lives once the node drains)
                    slot.done = True
                    continue
                self.spawner.spawn(slot)
            if self.spares.owed:
                self.spares.refill(
                    time.monotonic(),
                    _committed,
                    lambda s: self.spares.gpu_of(self.spawner.local(s)),
                )
            self.nodes.tick(time.monotonic())
            if self.config.torchft == "plain":
                self.exits.end_stopped()
                continue  # no heartbeats: torchft's own timeouts handle hangs
            now = time.monotonic()
            for slot in slots:
                self.verdicts.check_hang(slot, now)
            self.stragglers.tick(now)

    def _start_lighthouse(self) -> None:
        if self.config.torchft is not None:
            from fastft.integrations.torchft.launch import start_for_agent

            start_for_agent(self, die_with_parent)
            self.events.emit(
                "lighthouse_ready", kind=self.config.torchft, address=self.lighthouse_addr
            )

    @property
    def header(self) -> dict[str, Any]:
        """The header of what the agent publishes: no rank, no epoch of its own."""
        return dict(job=self.config.job, epoch=0, rank=NO_RANK, incarnation=0, role=Role.AGENT)

    @property
    def hosts_store(self) -> bool:
        """Whether this node's agent hosts the job's store (node 0 on a TCPStore)."""
        return self._server is not None

    def wake(self) -> None:
        """Wake the main loop (a restart due, a failure, a stop)."""
        self._wake.set()

    def fail(self, why: str) -> None:
        """Fail the job with ``why`` (the first reason stands: the earliest failure is the
        cause); the main loop stops the workers and the agent exits 1 with it."""
        if not self.failed:
            self.failed = why
        self._wake.set()

    def restart_later(self, slot: Slot, delay_s: float) -> None:
        """Start ``slot``'s next life from the main thread in ``delay_s`` (a child's
        PR_SET_PDEATHSIG fires when the thread that forked it ends)."""
        with self.children.lock:
            self._restarts_due.append((time.monotonic() + delay_s, slot))
        self._wake.set()

    def count_fault(self, rank: int, what: str) -> None:
        """A fault of ``rank``'s slot (:meth:`Exits.count_fault`)."""
        self.exits.count_fault(rank, what)

    def publish(self, msg: Message) -> None:
        try:
            self.bus.broadcast(msg)
        except BusClosed:  # (the job ended: a worker's exit claimed after the bus closed)
            log.debug("agent: %s after the bus closed", type(msg).__name__)
        except Exception:
            log.exception("agent: could not publish %s", type(msg).__name__)


def _committed(slot: Slot) -> bool:
    """Whether the slot's worker committed since it started (its heartbeat counts its
    commits)."""
    hb = read_heartbeat(slot.heartbeat)
    return hb is not None and hb.last >= slot.started and hb.commits > 0
