"""The judgement of link probes (:mod:`fastft.launch.gray.links`), pure: who is slow, which
pairs are broken, when to probe. Times in, decisions out; the probes, the store and the
agent's actions are ``links``'."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "CHUNK",
    "FAILED_S",
    "MIN_EXTRA_S",
    "PROBE_BUDGET_S",
    "PROBE_BYTES",
    "PROBE_EVERY_S",
    "PROBE_TIMEOUT_S",
    "PROBE_WAIT_S",
    "QUIET_S",
    "RING",
    "STUCK_FLOOR_S",
    "STUCK_STEPS",
    "Broken",
    "SlowLink",
    "Slowdown",
    "broken_pairs",
    "probe_targets",
    "slow_links",
    "stuck",
]

PROBE_BYTES = 1 << 18
"""What one probe sends (256 KiB: past a shaper's burst, ~2 ms on a healthy 1 Gbit/s link)."""
PROBE_TIMEOUT_S = 1.0
"""A probe whose connection or first chunk is not answered within this long failed."""
FAILED_S = 1000.0
"""What a failed probe's time reads (a chunk acknowledged, however slowly, is a time)."""
PROBE_BUDGET_S = 0.1
"""A probe sends for at most this long (then its time is scaled to ``PROBE_BYTES``)."""
CHUNK = 1 << 14
"""A probe sends chunks of this size, each acknowledged before the next."""
PROBE_WAIT_S = 2 * 2 * (2 * PROBE_TIMEOUT_S + PROBE_BUDGET_S) + 2.0
"""Node 0 judges a round with the results in after this long (a node's missing: left out)."""
PROBE_EVERY_S = 60.0
"""At most one round a slowdown asks for per this long."""
RING = 2
"""Each node probes this many next nodes around the ring (every node sends and receives
``RING`` probes: O(nodes) probes a round)."""
STUCK_FLOOR_S = 2.0
STUCK_STEPS = 20
"""Every member alive and waiting in the runtime for this many step times (at least
``STUCK_FLOOR_S``) asks for a probe round: a collective stuck with no one hung is a
network fault between members (a blackholed route: Gloo waited 60 s, then the pair
failed every re-formation until the fault storm's limit)."""
QUIET_S = 10.0
"""After a link is found slow or broken, the straggler check waits this long at least (3
recent-step windows if longer): the members' computes still hold the slow link's steps."""
MIN_EXTRA_S = 0.02
"""A slow link's probe takes at least this much longer than the others' (noise)."""


@dataclass(frozen=True)
class SlowLink:
    """A node whose link is slow in one direction: its probes against the others'."""

    node: int
    direction: str
    """``sends``, ``receives`` or ``both ways``."""
    seconds: float
    others_s: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.others_s

    def rate(self, seconds: float) -> float:
        """MB/s of one probe taking ``seconds``."""
        return PROBE_BYTES / max(seconds, 1e-6) / 1e6


def probe_targets(node: int, nnodes: int, width: int = RING) -> list[int]:
    """The nodes ``node`` probes: its next ``width`` around the ring (every other one if
    fewer)."""
    return [(node + k) % nnodes for k in range(1, min(width, nnodes - 1) + 1)]


def slow_links(times: Mapping[tuple[int, int], float], factor: float) -> list[SlowLink]:
    """The nodes whose every probe sent (or received) in ``times`` ((src, dst) ->
    seconds) took ``factor`` x the median of the probes between other nodes, by
    :data:`MIN_EXTRA_S` at least. None without probes that avoid a node (two nodes)."""
    times = {p: t for p, t in times.items() if t < FAILED_S}  # (a failure is not slowness)
    nodes = sorted({n for pair in times for n in pair})
    out = []
    for n in nodes:
        rest = [t for (s, d), t in times.items() if n not in (s, d)]
        if not rest:
            continue
        others = statistics.median(rest)
        slow = {}
        for direction, mine in (
            ("sends", [t for (s, _), t in times.items() if s == n]),
            ("receives", [t for (_, d), t in times.items() if d == n]),
        ):
            low = min(mine, default=0.0)
            if mine and low >= factor * others and low - others >= MIN_EXTRA_S:
                slow[direction] = statistics.median(mine)
        if len(slow) == 2:  # (a shaper's queue holds its TCP acks back too)
            out.append(SlowLink(n, "both ways", max(slow.values()), others))
        elif slow:
            ((direction, t),) = slow.items()
            out.append(SlowLink(n, direction, t, others))
    return out


@dataclass(frozen=True)
class Broken:
    """Pairs of nodes whose probes failed while each reaches the others: ``node`` is the
    one to take out (in the most of them; a tie: the higher number, never node 0 when
    another will do, since it hosts the TCPStore)."""

    node: int
    pairs: tuple[tuple[int, int], ...]


def broken_pairs(times: Mapping[tuple[int, int], float]) -> Broken | None:
    """The broken pairs of ``times`` (a probe that failed: :data:`FAILED_S`) and whom to
    exclude. None if none, and None if a node of a failed pair neither reached nor was
    reached by any other in this round: a node cut off whole (or cut mid-round) is the
    node lease's business, not a broken pair's."""
    failed = tuple(sorted(p for p, t in times.items() if t >= FAILED_S))
    if not failed:
        return None
    for n in {x for p in failed for x in p}:
        sends = [t < FAILED_S for (s, _), t in times.items() if s == n]
        receipts = [t < FAILED_S for (_, d), t in times.items() if d == n]
        if not any(sends) or not any(receipts):
            return None
    count: dict[int, int] = {}
    for p in failed:
        for n in p:
            count[n] = count.get(n, 0) + 1
    node = max(count, key=lambda n: (count[n], n != 0, n))
    return Broken(node, failed)


class Slowdown:
    """Whether the job's steps grew past ``factor`` x the fastest this world ran (see the
    module). Pure: :meth:`update` with the members' recent step times, 0 when unknown. The
    members' computes cannot tell a slow link from slow arithmetic: a collective inside
    the step counts as compute when it does not wait in the runtime. A probe costs a few
    hundred KiB per link, so any slowdown asks for one; a member computing slower than
    the others is the straggler check's to name."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._world: frozenset[int] = frozenset()
        self._best = 0.0
        """The job's fastest step time in this world."""

    def update(self, steps: Mapping[int, float]) -> str | None:
        """Why to probe now (None: no reason)."""
        if not steps or any(t <= 0 for t in steps.values()):
            return None
        step = statistics.median(steps.values())
        world = frozenset(steps)
        if world != self._world or not self._best or step < self._best:
            self._world, self._best = world, step
            return None
        if step >= self.factor * self._best and step - self._best >= MIN_EXTRA_S:
            return (
                f"steps take {step / self._best:.1f}x as long as this world's fastest "
                f"({step * 1e3:.0f} ms against {self._best * 1e3:.0f} ms)"
            )
        return None


def stuck(members: Mapping[int, tuple[float, float]]) -> str | None:
    """Why every member seems stuck in a collective (None: not all wait long)."""
    if len(members) < 2:
        return None
    step = statistics.median(t for t, _ in members.values())
    limit = max(STUCK_FLOOR_S, STUCK_STEPS * step)
    least = min(w for _, w in members.values())
    if least < limit:
        return None
    return f"every member alive and waiting in the runtime for {least:.1f} s"
