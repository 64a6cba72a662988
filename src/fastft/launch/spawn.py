"""A worker's life started by its node's agent (:class:`Spawner`): the worker's environment,
a warm spare given its order or a cold start (a fork of the node's zygote, or a new
process), its exit trace, and the ``spawn`` event."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets

from fastft.launch.control import ControlPlane
from fastft.launch.ports import AgentPorts
from fastft.launch.procs.children import Slot
from fastft.launch.procs.spare import order_line
from fastft.launch.settings.workerenv import worker_environment

__all__ = ["Spawner"]

log = logging.getLogger(__name__)


class Spawner:
    """Starts the lives of one node's workers; the agent's main thread calls it (a child's
    PR_SET_PDEATHSIG fires when the thread that forked it ends)."""

    def __init__(self, agent: AgentPorts, plane: ControlPlane) -> None:
        self.agent = agent
        self.plane = plane

    def local(self, slot: Slot) -> int:
        """The slot's rank on this node (``LOCAL_RANK``)."""
        return slot.rank - self.agent.config.node_rank * self.agent.config.nproc

    def spawn(self, slot: Slot, drawn: bool = False) -> None:
        """Start ``slot``'s next life (``drawn``: its incarnation drawn and recorded)."""
        a, plane = self.agent, self.plane
        cfg = a.config
        if not drawn:
            slot.incarnation = secrets.randbits(62) | 1
        slot.heartbeat = str(a.run_dir / f".heartbeat-{slot.rank}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.heartbeat)  # (the last life's: its commits are not this one's)
        trace_path = str(a.run_dir / f".exit-trace-{slot.rank}-{slot.life}")
        traced = cfg.exit_trace and a.children.tracer.refused is None
        env = worker_environment(
            cfg,
            rank=slot.rank,
            life=slot.life,
            incarnation=slot.incarnation,
            local_rank=self.local(slot),
            store_addr=plane.address,
            run_dir=str(a.run_dir),
            heartbeat_file=slot.heartbeat,
            exit_trace_file=trace_path if traced else None,
            lighthouse_addr=a.lighthouse_addr,
            secret_file=str(plane.secret_file),
            group_gen=a.ledger.generation(slot.rank // cfg.shard_size),
            relay_socket=plane.hub.address if plane.hub else None,
            job_started=plane.started,
        )
        try:
            os.unlink(slot.heartbeat)
        except FileNotFoundError:
            pass
        if not drawn:
            a.nodes.record_lives()
        gpu = a.spares.gpu_of(self.local(slot))
        taken = a.spares.take(gpu) if slot.life > 0 else None
        spare, ready = taken if taken is not None else (None, False)
        if spare is not None:
            try:
                assert spare.stdin is not None
                spare.stdin.write(order_line(env, list(cfg.command)))
                spare.stdin.close()
            except OSError:  # it died before it was needed: start the worker cold
                log.warning("warm spare %d is gone; starting rank %d cold", spare.pid, slot.rank)
                spare = None
        if spare is None and slot.spare_only:  # (the policy saw one a moment ago)
            a.events.emit("spare_missing", rank=slot.rank)
            log.warning("rank %d should start on a warm spare; none is left: cold", slot.rank)
        how = "spare"
        if spare is not None:
            a.children.adopt(slot, spare)
        else:
            how = a.children.popen(slot, list(cfg.command), env)
        if slot.spare_only:
            a.offenders.replaced(slot.rank)
            slot.spare_only = False
        assert slot.proc is not None
        if traced:
            a.children.trace_exit(slot, slot.proc.pid, trace_path)
        a.wake()
        a.events.emit(
            "spawn",
            rank=slot.rank,
            life=slot.life,
            pid=slot.proc.pid,
            incarnation=slot.incarnation,
            warm=spare is not None,
            how=how[:200],
            **({"spare_ready": ready} if spare is not None else {}),
        )
        if spare is not None:  # the next failure gets one too, once this one recovered
            a.spares.owe(slot)
