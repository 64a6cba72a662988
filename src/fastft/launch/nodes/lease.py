"""Node liveness: every agent of a multi-node job holds a lease in the control plane.

A parent sees its child die at once; nobody sees a node lost whole (a kernel panic, a dead
NIC, a reclaimed host). So each agent increments its lease counter every heartbeat, and
reads the counters of the nodes it watches in the same round trip: its next
``WATCHERS`` nodes around the ring of nodes that are neither lost nor done
(:func:`watched`), so that every node is watched by ``WATCHERS`` others and a round costs
the store O(nodes) reads, not O(nodes²) (issue 35: every agent reading every lease needed
~73 % of the store's core at 256 nodes). A counter that has not moved for
``misses`` heartbeats (by the reader's clock) is *expired*: the reader declares the node
lost by compare-and-set (one agent wins), and publishes every worker of that node dead
(Fault1) on the bus. The survivors roll back and go on (elastic world) or wait for the
node's workers to return (fixed world).

A node that was partitioned and comes back finds itself declared lost: its workers are
dead to the job (their incarnations are in every survivor's dead set, so they can neither
join nor vote in a later epoch), and its agent kills them and starts them again as new
incarnations, which heal. Then it clears the mark.

An agent that cannot reach the store for as long as a lease lasts stops the node: with the
embedded TCPStore, the store host (node 0) is gone, and the job cannot go on.

:class:`LeaseWatch` decides (pure: time comes in as arguments;
:mod:`fastft.launch.rules.leasewatch`); :class:`NodeLease` is the thread that reads and writes
the store and tells the agent. On the NATS control plane the counters are core-NATS beats
(:class:`~fastft.launch.nodes.beatlease.BeatLease`), not the bucket's.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fastft.bus.signed import ForgedValue
from fastft.launch.nodes.renewer import Renewer, store_sends
from fastft.launch.rules.leasewatch import DONE, WATCHERS, LeaseConfig, LeaseWatch, watched
from fastft.launch.rules.lives import mark_lost
from fastft.protocol.keys import JobKeys

__all__ = ["GUARD_LEASES", "GUARD_MIN_S", "NodeLease"]

log = logging.getLogger(__name__)

GUARD_LEASES = 3.0
GUARD_MIN_S = 2.0
"""The guard calls the store lost after this many of its graces without an answer, and
no sooner than this: a loaded store's slow round is not a lost one (the job would fail)."""


class NodeLease:
    """The agent's lease thread: renew, read the other leases, act on the verdict.

    ``on_lost(node, lives)``: this agent declared ``node`` lost (it won the
    compare-and-set); publish its workers dead. ``on_fenced()``: this node was declared
    lost while it could not renew (a partition, a stop): kill the workers, which restart
    as new incarnations; the mark is cleared after it returns. ``on_store_lost(reason)``:
    the store has not answered for a whole lease. ``on_job_failed(why)``: another node's
    agent failed the job (:meth:`fail`): this node ends too. ``on_returned(node)``:
    informational. ``on_done(node, done)``: a watched node's agent ended (its mark says
    done), or a new one cleared the mark. Each store call waits at most one lease (a store
    client of its own).
    On the NATS control plane: :class:`~fastft.launch.nodes.beatlease.BeatLease`."""

    ROUNDS_ANSWER = True
    """Whether a round that read without an error shows the store answering (with beats, a
    thread of their own reads the store's marks and says)."""

    @property
    def answers_every(self) -> float:
        """How often the store is asked something, at least (the guard allows two)."""
        return self.config.period_s

    def __init__(
        self,
        store: Any,
        keys: JobKeys,
        node: int,
        nnodes: int,
        config: LeaseConfig,
        *,
        on_lost: Callable[[int, dict[int, int], int], None],
        on_fenced: Callable[[str], None],
        on_store_lost: Callable[[str, bool], None],
        on_returned: Callable[[int], None] = lambda node: None,
        on_store_back: Callable[[], None] = lambda: None,
        on_job_failed: Callable[[str], None] = lambda why: None,
        on_done: Callable[[int, bool], None] = lambda node, done: None,
        clock: Callable[[], float] = time.monotonic,
        watchers: int = WATCHERS,
        renewers: int = 0,
    ) -> None:
        self.store = store.clone()
        self.store.set_timeout(datetime.timedelta(seconds=max(config.lease_s, 0.05)))
        self.keys = keys
        self.node = node
        self.others = [n for n in range(nnodes) if n != node]
        self.config = config
        self.on_lost = on_lost
        self.on_fenced = on_fenced
        self.on_store_lost = on_store_lost
        self.on_returned = on_returned
        self.on_store_back = on_store_back
        self.on_job_failed = on_job_failed
        self.on_done = on_done
        self._done: set[int] = set()
        """Watched nodes whose mark says their agent is done, as last told."""
        self.failed = ""
        """Why the job failed (another node's :meth:`fail`, or this one's), once read."""
        self.clock = clock
        self.watch = LeaseWatch(node, config, clock())
        self._renewals = 0
        self._renewer: Renewer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._answered = clock()
        """When the store last answered a round (the guard's clock: a call to a host cut
        off never returns, its TCP connection alive, and no round ends to say so)."""
        self._gone = threading.Lock()
        self._store_lost = False
        self.nnodes = nnodes
        self.watchers = watchers
        """How many nodes this agent watches (nnodes - 1: every other, as before issue 35)."""
        self.marks: dict[int, str] = {}
        """The lost marks of the watched nodes, as last read."""
        self._fenced: set[str] = set()
        self.rejoined = self._make_keys()
        """The mark this node found at its start (declared lost while its agent was gone;
        no worker of this agent to fence yet), cleared; "" if none."""
        # (``renewers``: on connections of their own, :mod:`.renewer`)
        sends = self._sends(store, renewers)
        if not sends:
            self._renew()
        self._renewer = Renewer(sends, period_s=config.period_s) if sends else None

    def _make_keys(self) -> str:
        """The keys this agent reads, made at its start; the lost mark this node found
        (cleared)."""
        keys, node, nnodes, watchers = self.keys, self.node, self.nnodes, self.watchers
        # The keys this agent reads exist from the start, so that one read gets them all
        # (a TCPStore read of a missing key waits for it): its own and its watched nodes'.
        for n in sorted({node, *watched(node, nnodes, {}, watchers)}):
            self.store.add(keys.node_lease(n), 0)
            try:
                self.store.compare_set(keys.node_lost(n), "", "")
            except ForgedValue:
                pass  # a forged mark reads as none
        try:
            self.store.compare_set(keys.failed, "", "")
        except ForgedValue as f:  # not the job's own: cleared, never acted on
            self.store.replace(keys.failed, f.raw, "")
        try:
            rejoined = bytes(self.store.get(keys.node_lost(node))).decode(errors="replace")
        except ForgedValue as f:  # no mark of this job's: clear it
            self.store.replace(keys.node_lost(node), f.raw, "")
            rejoined = ""
        if rejoined:
            self.store.compare_set(keys.node_lost(node), rejoined, "")
        return rejoined

    def _sends(self, store: Any, renewers: int) -> list[Callable[[], None]]:
        """The renewals, each on a connection of its own (none: the rounds renew)."""
        return store_sends(store, self.keys.node_lease(self.node), renewers, self.config.lease_s)

    def _renew(self) -> None:
        """Renew in the round (with a :class:`Renewer`, its clock renews instead)."""
        if self._renewer is None:
            self.store.add(self.keys.node_lease(self.node), 1)
            self._renewals += 1

    @property
    def renewals(self) -> int:
        """Renewals made (in the rounds, or handed to the :class:`Renewer`)."""
        return self._renewals + (self._renewer.ticks if self._renewer is not None else 0)

    def fail(self, why: str) -> None:
        """This node fails the job: tell every other agent (the first failure wins)."""
        try:
            got = bytes(self.store.compare_set(self.keys.failed, "", why)).decode()
        except Exception:
            log.warning("could not tell the other nodes that the job failed", exc_info=True)
            return
        self.failed = self.failed or got

    def start(self) -> NodeLease:
        self._answered = self.clock()
        if self._renewer is not None:
            self._renewer.start()
        self._thread = threading.Thread(target=self._run, name="fastft-node-lease", daemon=True)
        self._thread.start()
        threading.Thread(target=self._guard, name="fastft-lease-guard", daemon=True).start()
        return self

    def _lost_store(self, why: str, *, silent: bool = False) -> None:
        """``on_store_lost``, once until the store answers again (the round and the guard
        may both conclude it); ``silent``: it stopped answering (the guard), else its
        calls failed (refused, reset: nothing listens there any more)."""
        with self._gone:
            if self._store_lost or self._stop.is_set():
                return
            self._store_lost = True
        self.on_store_lost(why, silent)

    def _store_back(self) -> None:
        with self._gone:
            if not self._store_lost or self._stop.is_set():
                return
            self._store_lost = False
        self.on_store_back()

    def _guard(self) -> None:
        """The store lost when no round got an answer for the store's grace: a round
        blocked in a call to a host that vanished (its link cut: no reset, no error) says
        nothing by itself (a TCPStore client's socket has no read timeout)."""
        grace = max(GUARD_LEASES * self.config.grace_s, GUARD_MIN_S, 2 * self.answers_every)
        limit = grace + self.config.period_s
        while not self._stop.wait(self.config.period_s):
            silent = self.clock() - self._answered
            if silent > limit:
                self._lost_store(
                    f"the store did not answer for {silent:.1f} s (this node cut off from "
                    "its host, or the host gone)",
                    silent=True,
                )

    def stop(self) -> None:
        """End the rounds (and the renewals) without waiting; :meth:`close` waits too."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.close()

    def close(self) -> None:
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.config.lease_s + 1.0)

    def _run(self) -> None:
        self.rounds(self._stop)

    def rounds(self, stop: Any, on_read: Callable[[float, float], None] | None = None) -> None:
        """Renew, read and judge every heartbeat until ``stop.is_set()``, waiting with
        ``stop.wait(s)`` (the lease thread's loop; the scale model runs it on simulated
        time). ``on_read(began, ended)``: each round's read, by :attr:`clock`."""
        period = self.config.period_s
        next_at = self.clock()
        while not stop.is_set():
            next_at += period
            counters: dict[int, int] | None = None
            mark = failed = ""
            error = ""
            try:
                self._renew()
                began = self.clock()
                counters, mark, failed = self._read()
                if on_read is not None:
                    on_read(began, self.clock())
            except Exception as e:
                error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if stop.is_set():
                return
            if not error and self.ROUNDS_ANSWER:
                self._answered = self.clock()
                self._store_back()
            v = self.watch.round(self.clock(), counters, error)
            if v.store_lost is not None:
                self._lost_store(v.store_lost)
            if failed and not self.failed and not failed.startswith(f"node {self.node}:"):
                self.failed = failed  # (this node's own mark: read before fail() returned)
                self.on_job_failed(failed)
            if mark and mark != DONE:
                self._fence(mark)
            self._done_changes()
            for n in v.expired:
                self._declare(n)
            for n in v.returned:
                self.on_returned(n)
            delay = next_at - self.clock()
            if delay < -period:  # far behind (a stop, a pause): renew now, then on time
                next_at = self.clock()
                delay = 0
            stop.wait(max(0.0, delay))

    def _read(self) -> tuple[dict[int, int], str, str]:
        """One round trip: the watched nodes' counters and marks (the next round watches
        past a node found marked), this node's own mark, the job's failed mark."""
        nodes = watched(self.node, self.nnodes, self.marks, self.watchers)
        for n in nodes:
            if n not in self.marks:  # (a node newly watched: its keys may not exist yet)
                self.store.add(self.keys.node_lease(n), 0)
                self.store.compare_set(self.keys.node_lost(n), "", "")
        keys = [self.keys.node_lease(n) for n in nodes] + [self.keys.node_lost(n) for n in nodes]
        got = self.store.multi_get([*keys, self.keys.node_lost(self.node), self.keys.failed])
        k = len(nodes)
        counters = {n: int(bytes(v) or b"0") for n, v in zip(nodes, got[:k], strict=True)}
        self.marks = {
            n: bytes(v).decode(errors="replace") for n, v in zip(nodes, got[k : 2 * k], strict=True)
        }
        # (a forged value reads b"")
        return (
            counters,
            bytes(got[-2]).decode(errors="replace"),
            bytes(got[-1]).decode(errors="replace"),
        )

    def running(self) -> list[int]:
        """The other nodes that started and are neither done nor declared lost, read now
        from every node's keys (the store's host asks this as the job ends, not per round)."""
        keys = [self.keys.node_lease(n) for n in self.others]
        marks = [self.keys.node_lost(n) for n in self.others]
        if not self.store.check([*keys, *marks]):
            got = [self._value(k) for k in (*keys, *marks)]
        else:
            got = [bytes(v) for v in self.store.multi_get([*keys, *marks])]
        k = len(self.others)
        return [
            n
            for n, lease, mark in zip(self.others, got[:k], got[k:], strict=True)
            if int(lease or b"0") > 0 and not mark
        ]

    def _value(self, key: str) -> bytes:
        return bytes(self.store.get(key)) if self.store.check([key]) else b""

    def _declare(self, node: int) -> None:
        counter = self.watch.counter(node)
        got = self._mark_lost(node, counter)
        if got is not None:
            self.on_lost(node, got[0], counter)

    def _mark_lost(self, node: int, counter: int) -> tuple[dict[int, int], str] | None:
        try:
            return mark_lost(self.store, self.keys, node, self.node, counter)
        except Exception:
            log.warning("node %d: could not declare it lost", node, exc_info=True)
            self.watch.lost.discard(node)  # (declared again at the next round)
            return None

    def _done_changes(self) -> None:
        """``on_done(node, True)`` when a watched node's mark turns to done (its agent
        ended: the job's end, or a drain), ``False`` when it is cleared (a new agent)."""
        for n, m in list(self.marks.items()):
            if (m == DONE) != (n in self._done):
                (self._done.add if m == DONE else self._done.discard)(n)
                self.on_done(n, m == DONE)

    def say_done(self) -> None:
        """This node is done (with beats, the watchers are told before its beats stop)."""

    def set_lives(self, lives: dict[int, int]) -> None:
        """This node's worker lives (with beats, which carry them)."""

    def take_over(self) -> dict[int, int] | None:
        """This agent replaces its node's dead one (``--standby``, told to go): the lives
        that agent left are declared dead now, as a watcher would once the lease ran out,
        and the mark cleared (the node is back). Their ranks and incarnations; None if
        the node was declared lost already (:attr:`rejoined`) or the store failed."""
        if self.rejoined:
            return None
        got = self._mark_lost(self.node, self.renewals)
        if got is None:
            return None
        lives, mark = got
        self.store.compare_set(self.keys.node_lost(self.node), mark, "")
        return lives

    def _fence(self, mark: str) -> None:
        """This node was declared lost: the agent kills its workers; then clear the mark
        (compare-and-set: a newer declaration stays)."""
        if mark in self._fenced:  # (with beats the mark read may be one round old)
            return
        self._fenced.add(mark)
        self.on_fenced(mark)
        try:
            self.store.compare_set(self.keys.node_lost(self.node), mark, "")
        except Exception:
            log.warning("could not clear this node's lost mark", exc_info=True)
