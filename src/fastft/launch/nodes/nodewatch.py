"""Node liveness for the agent (multi-node): each agent renews its node's lease in the
store and watches the others' (:class:`~fastft.launch.nodes.lease.NodeLease`). This is what the
agent does with the lease's verdicts: a node lost (its workers are dead: Fault1 for each,
on the bus), this node fenced (declared lost while it could not renew: its workers are
killed and start again as new lives), the store lost (the job cannot go on). The agent's
part for it, as :class:`~fastft.launch.exits.Exits` is for its workers' exits."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from fastft.bus.natsio import pinned
from fastft.launch.nodes.beatlease import BeatLease
from fastft.launch.nodes.beats import Beats
from fastft.launch.nodes.lease import NodeLease
from fastft.launch.nodes.peerbeats import PeerBeats, PeerLease, peer_beats
from fastft.launch.nodes.renewer import RENEWERS
from fastft.launch.rules.leasewatch import (
    DEFAULT_MISSES,
    DONE,
    NATS_MISSES,
    NATS_STORE_GRACE_S,
    LeaseConfig,
)
from fastft.launch.rules.leftnodes import LeftNodes, needs_node
from fastft.launch.rules.lives import declared_lives, format_lives
from fastft.protocol import Fault, Severity

if TYPE_CHECKING:
    from fastft.launch.ports import AgentPorts

__all__ = ["NodeWatch"]

log = logging.getLogger(__name__)


class NodeWatch:
    """The agent's node lease and what it does with its verdicts (see the module)."""

    def __init__(self, agent: AgentPorts) -> None:
        self.agent = agent
        self.store_gone = False
        self.store_wait_until = 0.0
        """While the store does not answer (a TCPStore): when the job fails (0: it answers)."""
        self.store_why = ""
        self.lease: NodeLease | None = None
        """This node's lease (several nodes only), its one owner."""
        self.alone_until = 0.0
        self.left = LeftNodes()
        """Nodes that left before the job finished, which this world cannot do without."""
        """The store's host with every other node lost and too few workers of its own to
        go on: when the job fails unless one returns (0: not so)."""

    def start(self) -> None:
        a = self.agent
        cfg = a.config
        if cfg.nnodes < 2:
            return  # nobody else to watch; the store is this node's own
        lease_type: Any = NodeLease
        how = "store"
        if cfg.control:
            lease_type, how = partial(BeatLease, beats=self._beats()), "nats"
        elif peer_beats(cfg.node_beats, cfg.nnodes):
            lease_type, how = partial(PeerLease, beats=self._peer_beats()), "peers"
        self.lease = lease = lease_type(
            a.store,
            a.keys,
            cfg.node_rank,
            cfg.nnodes,
            LeaseConfig(
                cfg.node_heartbeat_ms,
                cfg.node_lease_misses or (NATS_MISSES if cfg.control else DEFAULT_MISSES),
                store_grace_s=NATS_STORE_GRACE_S if cfg.control else None,
            ),
            on_lost=self.node_lost,
            on_fenced=self.fenced,
            on_store_lost=self.store_lost,
            on_store_back=self.store_back,
            on_returned=self.returned,
            on_job_failed=self.job_failed,
            on_done=self.node_done,
            renewers=0 if cfg.control else RENEWERS,  # (a TCPStore: a connection each)
        )
        a.events.emit("node_lease", beats=how, lease_s=lease.config.lease_s)
        if lease.rejoined:
            a.events.emit("node_rejoined", mark=lease.rejoined)
        lives = lease.take_over() if cfg.standby else None  # (told to go: the agent died)
        if lives is not None:
            self.took_over(lives)
        lease.start()

    def _peer_beats(self) -> PeerBeats:
        """A TCPStore job's lease beats from agent to agent (``--node-beats``)."""
        a = self.agent
        sign, verify = self._signature()
        misses = a.config.node_lease_misses or DEFAULT_MISSES
        return PeerBeats(
            a.store,
            a.keys,
            a.config.node_rank,
            sign,
            verify,
            toward=a.config.store or "127.0.0.1:0",
            timeout_s=a.config.node_heartbeat_ms / 1000 * misses,
        )

    def _signature(self) -> tuple[Callable[[str, str], str], Callable[[str, bytes], str | None]]:
        """The job secret's value signature (none with the store insecure)."""
        store = self.agent.store
        auth = getattr(store, "auth", None)
        if auth is None or getattr(store, "insecure", False):
            return (
                (lambda key, value: value),
                (lambda key, raw: bytes(raw).decode(errors="replace")),
            )
        return auth.sign, auth.verify

    def _beats(self) -> Beats:
        """The NATS control plane's lease beats: clients of their own, one per server of
        the cluster (up to :data:`RENEWERS`), signed with the job secret."""
        a = self.agent
        store = a.store
        conns = pinned(store.conn.servers, RENEWERS, timeout_s=10.0)
        sign, verify = self._signature()
        lease_s = a.config.node_heartbeat_ms / 1000 * (a.config.node_lease_misses or NATS_MISSES)
        return Beats(conns, a.keys.job, a.config.node_rank, sign, verify, timeout_s=lease_s)

    def took_over(self, lives: dict[int, int]) -> None:
        """This agent replaced its node's dead one before any other agent declared the
        node lost: the workers that agent left are dead (Fault1 each, now: not after the
        lease)."""
        a = self.agent
        node = a.config.node_rank
        a.events.emit("node_taken_over", node=node, ranks=sorted(lives))
        for rank, inc in lives.items():
            a.publish(
                Fault(
                    **a.header,
                    severity=Severity.FAULT1,
                    cause=f"node {node}'s agent died (a standby agent took the node over)",
                    faulty_rank=rank,
                    faulty_incarnation=inc,
                )
            )

    def record_lives(self) -> None:
        """Write this node's worker lives to the store (several nodes only): whom a
        watcher declares dead if the node is lost. Before a life starts."""
        a = self.agent
        if self.lease is None:
            return
        lives = {s.rank: s.incarnation for s in a.slots.values() if s.incarnation}
        self.lease.set_lives(lives)
        try:
            a.store.set(a.keys.node_lives(a.config.node_rank), format_lives(lives))
        except Exception as e:
            log.warning("could not record this node's workers in the store: %s", e)

    def node_lost(self, node: int, lives: dict[int, int], counter: int) -> None:
        """This agent declared ``node`` lost: every worker of it is dead (Fault1)."""
        lease = self.lease
        assert lease is not None
        lease_ms = round(lease.config.lease_s * 1000)
        self.agent.events.emit(
            "node_lost",
            node=node,
            lease=counter,
            lives=len(lives),
            ranks=sorted(lives),
            lease_ms=lease_ms,
        )
        log.warning("node %d lost: its lease was not renewed for %d ms", node, lease_ms)
        self._alone(lease)
        for rank, inc in lives.items():
            self.agent.publish(
                Fault(
                    **self.agent.header,
                    severity=Severity.FAULT1,
                    cause=f"node {node} lost (lease not renewed for {lease_ms} ms)",
                    faulty_rank=rank,
                    faulty_incarnation=inc,
                )
            )

    def _alone(self, lease: NodeLease) -> None:
        """Every other node lost at once, seen from the store's host (a TCPStore's node 0)
        whose own workers are fewer than the job needs: this node was cut off from the
        others (they stop, saying the store host is gone, and end after ``--store-wait``)
        or they are all gone. Said now; the job fails after ``--store-wait`` unless one
        comes back (it waited for restarts for ever, its worker killed as hung)."""
        a = self.agent
        cfg = a.config
        can_go_on = cfg.min_replicas is not None and cfg.min_replicas <= cfg.nproc
        if self.alone_until or cfg.control or cfg.node_rank != 0 or can_go_on:
            return
        if not lease.watch.all_lost():
            return
        self.alone_until = time.monotonic() + cfg.store_wait_s
        a.events.emit("store_host_alone", wait_s=cfg.store_wait_s)
        print(
            f"fastft: every other node is lost: this node hosts the job's store and is cut "
            f"off from them, or they are gone; its workers cannot go on alone. Waiting up to "
            f"{cfg.store_wait_s:g} s (--store-wait) for one to return",
            file=sys.stderr,
            flush=True,
        )

    def returned(self, node: int) -> None:
        """A node declared lost renews its lease again (a cut mended)."""
        self.agent.events.emit("node_returned", node=node)
        if self.alone_until:
            self.alone_until = 0.0
            print(f"fastft: node {node} is back", file=sys.stderr, flush=True)

    def node_done(self, node: int, done: bool) -> None:
        """A node this agent watches ended (``done``), or a new agent started on it. A node
        that ended before the job finished drained (a SIGTERM to its agent: a preemption);
        where the job cannot go on without its workers (a fixed world), its survivors
        wait for them as for a lost node's: said now, and the job fails after
        ``--store-wait`` unless the node's agent starts again (a scheduler's replacement)."""
        a, cfg = self.agent, self.agent.config
        wait = cfg.store_wait_s
        if not done:
            if self.left.back(node):
                a.events.emit("node_back", node=node)
                print(f"fastft: node {node}'s agent started again", file=sys.stderr, flush=True)
            return
        if a.failed or a.stopping is not None or a.draining is not None:
            return  # (this node ends too)
        if not needs_node(cfg.world_size, cfg.nproc, cfg.min_replicas):
            return  # (an elastic world goes on without its workers)
        try:
            if a.store.check([a.keys.finished]):
                return  # the job's end: every node ends
        except Exception as e:  # (the store's own trouble: its watch says so)
            log.debug("could not read the finished mark: %s", e)
            return
        if not self.left.left(node, time.monotonic() + wait):
            return
        a.events.emit("node_left", node=node, wait_s=wait)
        print(
            f"fastft: node {node} left the job before it finished (its agent drained: a "
            f"preemption); the job cannot go on without its workers (--min-replicas lets the "
            f"world shrink): waiting up to {wait:g} s (--store-wait) for its agent to start "
            "again",
            file=sys.stderr,
            flush=True,
        )

    def fenced(self, mark: str) -> None:
        """This node was declared lost while it could not renew (a partition, a stop): the
        workers it named are dead to the job; kill them, and they restart as new
        incarnations. A worker restarted since (while the node was cut off, it lost the
        store and exited) is a newer life than the verdict's: it lives (it joins as one)."""
        a = self.agent
        lives = declared_lives(mark)
        a.events.emit("node_fenced", mark=mark)
        log.warning("this node was declared lost: restarting the workers it named")
        for slot in a.slots.values():
            inc = slot.incarnation
            if slot.done or not inc:
                continue
            if lives is not None and lives.get(slot.rank) != inc:
                a.events.emit(
                    "fence_spared", rank=slot.rank, incarnation=inc, declared=lives.get(slot.rank)
                )
                continue
            a.ledger.fence(inc)
            a.children.kill(slot, incarnation=inc)

    def job_failed(self, why: str) -> None:
        """Another node's agent failed the job: this node ends too (exit 1, its workers
        stopped), instead of waiting for ranks nobody will start again."""
        a = self.agent
        a.events.emit("job_failed_elsewhere", reason=why)
        if not a.failed:
            log.error("the job failed on another node: %s", why)
            a.fail(f"the job failed on another node: {why}")

    def finish(self, failed: str | None, timeout_s: float) -> None:
        """The agent ends (cleanly, or failed): tell the others, and on the node that
        hosts the store wait (at most ``timeout_s``) until every other agent that started
        is done or lost, so that none loses the store before it has heard."""
        a = self.agent
        lease = self.lease
        if lease is None or self.store_gone:
            return
        if failed and not lease.failed:
            lease.fail(f"node {a.config.node_rank}: {failed}")
        hosts = a.hosts_store
        lease.say_done()  # (with beats: before they stop, or the watchers declare it lost)
        if not hosts:
            lease.close()  # node 0 may close the store from now on
        done_key = f"{a.keys.root}/agents_done"
        try:
            a.store.compare_set(a.keys.node_lost(a.config.node_rank), "", DONE)  # not lost
            a.store.add(done_key, 1)
            deadline = time.monotonic() + timeout_s
            while hosts and int(a.store.add(done_key, 0)) < a.config.nnodes:
                running = lease.running()  # (every node's keys, read at the end only)
                if not running or time.monotonic() > deadline:
                    break  # the others are done, lost (their leases ran out) or never started
                time.sleep(0.05)
        except Exception:
            log.warning("could not tell the other nodes this one is done", exc_info=True)

    def store_lost(self, reason: str, silent: bool = False) -> None:
        """The store is lost. On NATS: the job fails (a majority of the cluster is gone).
        On a TCPStore whose calls fail (refused, reset: node 0's agent, which held the
        store in its memory, is gone): the job fails. On a TCPStore that stopped
        answering (``silent``): this node is cut off from node 0, or node 0 is gone, and
        nothing here tells which: its workers stop at once (they cannot commit without
        the store, and the other nodes declare this node lost meanwhile), and the agent
        waits up to ``--store-wait`` for it to answer again (:meth:`tick`), then starts
        them again as new lives, or fails the job."""
        a = self.agent
        self.store_gone = True
        a.events.emit("store_lost", reason=reason, silent=silent)
        if a.config.control:
            a.fail(
                f"the NATS control plane is unreachable: {reason}. A majority of its "
                "servers must be up (--control)"
            )
            return
        if not silent:
            a.fail(
                f"the store host is gone: {reason}. Node 0 hosts the job's store: with it "
                "the job cannot go on (--control nats://... survives it)"
            )
            return
        self.store_wait_until = time.monotonic() + a.config.store_wait_s
        self.store_why = reason
        print(
            f"fastft: {reason}: this node's workers stop (they cannot commit without the "
            f"store) and start again once it answers; waiting for it up to "
            f"{a.config.store_wait_s:g} s (--store-wait)",
            file=sys.stderr,
            flush=True,
        )
        for slot in a.slots.values():
            inc = slot.incarnation
            if not slot.done and inc:
                a.ledger.fence(inc)  # (not the script's failure: its exit restarts it)
                a.children.kill(slot, incarnation=inc)

    def store_back(self) -> None:
        """The store answers again (a cut mended): the workers restarted meanwhile join
        as new lives; the lease's own mark, if the others declared this node lost, fences
        only the lives it named (:meth:`fenced`)."""
        a = self.agent
        waited = a.config.store_wait_s - (self.store_wait_until - time.monotonic())
        self.store_gone = False
        self.store_wait_until = 0.0
        a.events.emit("store_back", waited_s=round(waited, 3))
        print(f"fastft: the store answers again after {waited:.1f} s", file=sys.stderr, flush=True)

    def tick(self, now: float) -> None:
        """From the agent's loop: the job fails once the store has not answered for
        ``--store-wait``."""
        for node in self.left.overdue(now):
            if not self.agent.failed:
                self.agent.fail(
                    f"node {node} left the job before it finished (its agent drained) and "
                    f"did not start again within {self.agent.config.store_wait_s:g} s "
                    "(--store-wait): the job cannot go on without its workers (--min-replicas "
                    "lets the world shrink; an agent started again on the node within the "
                    "wait rejoins the job)"
                )
        if self.alone_until and now > self.alone_until and not self.agent.failed:
            self.agent.fail(
                f"every other node is lost and none came back within "
                f"{self.agent.config.store_wait_s:g} s (--store-wait): this node, the host of "
                "the job's store, was cut off from them, or they are gone; its workers cannot "
                "go on alone (--control nats://... survives a host's loss)"
            )
        if self.store_wait_until and now > self.store_wait_until and not self.agent.failed:
            self.agent.fail(
                f"the store host is gone: {self.store_why}, and still after "
                f"{self.agent.config.store_wait_s:g} s (--store-wait). Node 0 hosts the job's "
                "store: without it the job cannot go on (--control nats://... survives it)"
            )
