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

:class:`LeaseWatch` decides (pure: time comes in as arguments); :class:`NodeLease` is the
thread that reads and writes the store and tells the agent.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastft.bus.signed import ForgedValue
from fastft.errors import ConfigError
from fastft.launch.lives import mark_lost
from fastft.protocol.keys import JobKeys

__all__ = [
    "DONE",
    "DEFAULT_HEARTBEAT_MS",
    "DEFAULT_MISSES",
    "NATS_MISSES",
    "NATS_STORE_GRACE_S",
    "LeaseConfig",
    "LeaseWatch",
    "NodeLease",
    "Verdict",
    "WATCHERS",
    "watched",
]

log = logging.getLogger(__name__)

DONE = "done"
"""The lost mark of a node whose agent finished: it is never declared lost."""
NATS_STORE_GRACE_S = 15.0
"""With the NATS control plane: how long every round may fail before an agent gives up on
the cluster (a stream leader's election after a server is lost takes seconds)."""
DEFAULT_HEARTBEAT_MS = 100
"""How often an agent renews its lease (``--node-heartbeat-ms``)."""
DEFAULT_MISSES = 3
"""Renewals a node may miss before it is declared lost (``--node-lease-misses``): the lease
lasts 300 ms by default."""
NATS_MISSES = 30
"""The default on the NATS control plane: 3 s. A client whose server is cut off finds
another within ~0.5 s, a JetStream leader election takes 1-3 s, and TCP resends a packet
lost in a flap after 0.2, 0.6, 1.4 s: on a 300 ms lease each cost the job healthy nodes
(``tests/net/test_nats_faults.py``)."""
WATCHERS = 3
"""How many agents watch each node's lease (its predecessors on the ring): a node is
declared lost unless all of them are lost with it."""


def watched(me: int, nnodes: int, marks: dict[int, str], width: int = WATCHERS) -> list[int]:
    """The nodes agent ``me`` watches: its successors on the ring, the first ``width`` of
    them whose lost mark (``marks``, as last read; unknown: none) is empty, and the marked
    ones met on the way (a lost node's lease is still read: it may come back). Pure."""
    out: list[int] = []
    clear = 0
    for i in range(1, nnodes):
        n = (me + i) % nnodes
        out.append(n)
        if not marks.get(n):
            clear += 1
            if clear == width:
                break
    return out


@dataclass(frozen=True)
class LeaseConfig:
    """``store_grace_s``: how long the store may fail every round before this agent gives
    up on it (None: one lease; a NATS cluster's leader election takes seconds)."""

    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS
    misses: int = DEFAULT_MISSES
    store_grace_s: float | None = None

    def __post_init__(self) -> None:
        if not 10 <= self.heartbeat_ms <= 60_000:
            raise ConfigError(f"--node-heartbeat-ms {self.heartbeat_ms}: use 10 .. 60000")
        if not 2 <= self.misses <= 1000:
            raise ConfigError(f"--node-lease-misses {self.misses}: use 2 .. 1000")

    @property
    def period_s(self) -> float:
        return self.heartbeat_ms / 1000

    @property
    def lease_s(self) -> float:
        """How long a lease lasts without a renewal."""
        return self.period_s * self.misses

    @property
    def grace_s(self) -> float:
        return self.lease_s if self.store_grace_s is None else max(self.store_grace_s, self.lease_s)


@dataclass
class Verdict:
    """What one round concluded. ``expired``: nodes whose lease just ran out (declare them
    lost); ``returned``: nodes declared lost whose lease moved again; ``store_lost``: this
    agent has not reached the store for a whole lease (the reason), else None."""

    expired: list[int] = field(default_factory=list)
    returned: list[int] = field(default_factory=list)
    store_lost: str | None = None


class LeaseWatch:
    """The lease counters one agent has seen, and what they mean. Pure.

    A node is watched from the first time its counter is seen above 0 (its agent started).
    Staleness is measured by this agent's clock between its own rounds; a round that comes
    late (this agent was descheduled or stopped), or the first one after rounds that could
    not reach the store (nobody could renew meanwhile: a NATS leader election), gives every
    node a fresh lease instead of blaming them for this agent's pause."""

    def __init__(self, me: int, config: LeaseConfig, now: float) -> None:
        self.me = me
        self.config = config
        self._moved: dict[int, tuple[int, float]] = {}
        """node -> (counter, when this agent last saw it change)."""
        self.lost: set[int] = set()
        self._last_round = now
        self._last_ok = now
        self._errors = 0
        self._last_error = ""

    def round(self, now: float, counters: dict[int, int] | None, error: str = "") -> Verdict:
        """One round: ``counters`` are the other nodes' lease counters read now (None: the
        store could not be reached, ``error`` says why)."""
        v = Verdict()
        late = now - self._last_round > self.config.lease_s / 2 or self._errors > 0
        self._last_round = now
        if counters is None:
            self._errors += 1
            self._last_error = error
            if self._errors >= self.config.misses and now - self._last_ok >= self.config.grace_s:
                v.store_lost = (
                    f"no answer for {(now - self._last_ok) * 1000:.0f} ms "
                    f"({self._errors} tries): {self._last_error}"
                )
            return v
        self._errors = 0
        self._last_ok = now
        for node, value in counters.items():
            if node == self.me or value <= 0:
                continue
            seen = self._moved.get(node)
            if seen is None or seen[0] != value or late:
                self._moved[node] = (value, now)
                if seen is not None and seen[0] != value and node in self.lost:
                    self.lost.discard(node)
                    v.returned.append(node)
                continue
            if node not in self.lost and now - seen[1] >= self.config.lease_s:
                self.lost.add(node)
                v.expired.append(node)
        return v

    def all_lost(self) -> bool:
        """Whether every other node this agent saw start is lost now (this node alone)."""
        return bool(self._moved) and self._moved.keys() <= self.lost

    def counter(self, node: int) -> int:
        """The counter last seen for ``node`` (0: never)."""
        seen = self._moved.get(node)
        return seen[0] if seen else 0


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
    informational. Each store call waits at most one lease (a store client of its own)."""

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
        clock: Callable[[], float] = time.monotonic,
        watchers: int = WATCHERS,
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
        self.failed = ""
        """Why the job failed (another node's :meth:`fail`, or this one's), once read."""
        self.clock = clock
        self.watch = LeaseWatch(node, config, clock())
        self.renewals = 0
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
            self.rejoined = bytes(self.store.get(keys.node_lost(node))).decode(errors="replace")
        except ForgedValue as f:  # no mark of this job's: clear it
            self.store.replace(keys.node_lost(node), f.raw, "")
            self.rejoined = ""
        """The mark this node found at its start (declared lost while its agent was gone;
        no worker of this agent to fence yet), cleared; "" if none."""
        if self.rejoined:
            self.store.compare_set(keys.node_lost(node), self.rejoined, "")
        self._renew()

    def _renew(self) -> None:
        self.store.add(self.keys.node_lease(self.node), 1)
        self.renewals += 1

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
        limit = max(GUARD_LEASES * self.config.grace_s, GUARD_MIN_S) + self.config.period_s
        while not self._stop.wait(self.config.period_s):
            silent = self.clock() - self._answered
            if silent > limit:
                self._lost_store(
                    f"the store did not answer for {silent:.1f} s (this node cut off from "
                    "its host, or the host gone)",
                    silent=True,
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.config.lease_s + 1.0)

    def _run(self) -> None:
        period = self.config.period_s
        next_at = self.clock()
        while not self._stop.is_set():
            next_at += period
            counters: dict[int, int] | None = None
            mark = failed = ""
            error = ""
            try:
                self._renew()
                counters, mark, failed = self._read()
            except Exception as e:
                error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if self._stop.is_set():
                return
            if not error:
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
            for n in v.expired:
                self._declare(n)
            for n in v.returned:
                self.on_returned(n)
            delay = next_at - self.clock()
            if delay < -period:  # far behind (a stop, a pause): renew now, then on time
                next_at = self.clock()
                delay = 0
            self._stop.wait(max(0.0, delay))

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
        self.on_fenced(mark)
        try:
            self.store.compare_set(self.keys.node_lost(self.node), mark, "")
        except Exception:
            log.warning("could not clear this node's lost mark", exc_info=True)
