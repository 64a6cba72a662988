"""The node lease's pure part (:mod:`fastft.launch.nodes.lease`): its settings, the nodes an
agent watches (:func:`watched`), and :class:`LeaseWatch`, which decides from the counters
read what expired, what returned and whether the store is lost. No I/O; time comes in as
arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastft.errors import ConfigError

__all__ = [
    "DONE",
    "DEFAULT_HEARTBEAT_MS",
    "DEFAULT_MISSES",
    "NATS_MISSES",
    "NATS_STORE_GRACE_S",
    "LeaseConfig",
    "LeaseWatch",
    "Verdict",
    "WATCHERS",
    "held_after_return",
    "watched",
]

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
NATS_MISSES = DEFAULT_MISSES
"""The default on the NATS control plane: 300 ms, as on a TCPStore, since the leases are
core-NATS beats on clients held to different servers (:mod:`fastft.launch.nodes.beats`). On the
bucket's counters it had to be 3 s: a JetStream write waits for the stream's leader, whose
election after its server is cut off takes seconds (issue 60, case 5)."""
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


def held_after_return(
    now: float, own_at: float, back_at: float, gap_s: float, heard_at: float, lease_s: float
) -> bool:
    """Whether a watcher holds its verdict on a node whose lease ran out because it may be
    the one cut off: it last heard its own beats at ``own_at``; they came back at
    ``back_at`` (0: never) after ``gap_s`` of silence; it last heard the node at
    ``heard_at`` (0: never). Pure.

    Its own beats unheard for two thirds of a lease: held (the others' last beats may have
    come a round before its own last one: a watcher cut off with its node judged them
    before it found itself silent, and declared both healthy nodes of three lost). For two
    leases after its own beats' return it declares nobody (what it hears may still be in
    retransmission). Past that, a node it has not heard since its return is held for
    ``gap_s`` more: a cut node's connections come back one by one, each when TCP next
    retransmits, and the retransmissions back off as long as the cut lasted (after an 8 s
    cut the others' beats were unheard for up to 5.9 s after the mend while the returning
    node heard its own). A node heard after the return and silent for a lease since is
    judged as usual; one never heard is declared once the hold ends (it died while this
    watcher was cut off; its other watchers have declared it already)."""
    if now - own_at > lease_s * 2 / 3:
        return True
    if not back_at:
        return False
    since = now - back_at
    if since < 2 * lease_s:
        return True
    return heard_at < back_at and since < gap_s + 2 * lease_s


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
