"""Stragglers (issue 50): a member whose steps compute slower than its peers' makes every
step of every member wait for it, with no fault to see. The agents find it and name it.

**What is measured.** Each worker's heartbeat (:mod:`fastft.process.heartbeat`) carries
its *compute*: the median, over its last 10 clean steps, of the longest silence of its
main thread in a step, from the step's start to its wait in the gradient collective. Its
peers' waits do not count (they are waits, not silences): a slow member's compute grows,
the others' stays. It costs nothing in the step: the heartbeat is written anyway.

**Who compares.** One agent sees every member: with one node its own heartbeats; with
several, each agent writes its workers' computes to the store every
:data:`EXCHANGE_S` (one key per node, off every step's path) and node 0's agent reads
them all. A member whose compute exceeds ``--straggler-factor`` (1.3) times the median
of the others', by at least :data:`MIN_EXTRA_S`, is *named*, once per life: an event
(``straggler``), a line of the agent's output, a metric and a row of ``fastft report``.

**What is done** (``--stragglers``): ``report`` (the default) names it; ``replace`` also
asks it to drain (``DrainRequest``: it leaves after its next commit, nothing rolled
back) and its agent starts it again, on a warm spare when there is one; each
replacement is a fault of its slot for the repeat-offender count
(:mod:`fastft.launch.rules.offenders`), so a slot that keeps straggling is quarantined.
``off``: nothing is compared.
"""

from __future__ import annotations

import json
import logging
import queue
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastft.launch.gray.links import Links
from fastft.process.beat import RECENT_STEPS, read_heartbeat
from fastft.protocol import DrainRequest, Message

if TYPE_CHECKING:
    from fastft.launch.ports import AgentPorts

__all__ = [
    "EXCHANGE_S",
    "MIN_EXTRA_S",
    "Slow",
    "StragglerWatch",
    "Stragglers",
    "slow_members",
]

log = logging.getLogger(__name__)

EXCHANGE_S = 0.5
"""How often the agents look (and, with several nodes, write their workers' computes)."""
Figures = tuple[int, float, float, float, int]
"""A worker's figures: incarnation, compute, step time, seconds waited, their epoch."""
MIN_EXTRA_S = 0.005
"""A straggler computes at least this much longer than the others per step (a ratio of
two tiny computes is noise)."""


@dataclass(frozen=True)
class Slow:
    """A member named slow: its compute per step against the median of the others'."""

    rank: int
    incarnation: int
    compute_s: float
    others_s: float

    @property
    def ratio(self) -> float:
        return self.compute_s / self.others_s


def slow_members(
    computes: Mapping[int, tuple[int, float]],
    factor: float,
    epochs: Mapping[int, int] | None = None,
) -> list[Slow]:
    """The members of ``computes`` (rank -> (incarnation, compute in seconds; 0: not
    known yet)) whose compute exceeds ``factor`` x the median of the others' known ones
    by :data:`MIN_EXTRA_S` at least; fewer than 2 known: none. ``epochs`` (rank -> the
    epoch its figure was measured in): only the figures of the newest epoch are compared
    (a re-formation changes each member's share; a node cut off leaves its last figure
    behind, and the survivor computing its share was named slow against it)."""
    known = {r: v for r, v in computes.items() if v[1] > 0}
    if epochs is not None and known:
        newest = max(epochs.get(r, 0) for r in known)
        known = {r: v for r, v in known.items() if epochs.get(r, 0) == newest}
    out = []
    for r, (inc, c) in sorted(known.items()):
        others = [v[1] for k, v in known.items() if k != r]
        if not others:
            continue
        median = statistics.median(others)
        if c > factor * median and c - median >= MIN_EXTRA_S:
            out.append(Slow(r, inc, c, median))
    return out


class StragglerWatch:
    """Which lives were named (each once). Pure."""

    def __init__(self) -> None:
        self._named: set[tuple[int, int]] = set()

    def newly(self, slow: list[Slow]) -> list[Slow]:
        """The members of ``slow`` not named before, now named."""
        new = [s for s in slow if (s.rank, s.incarnation) not in self._named]
        self._named.update((s.rank, s.incarnation) for s in new)
        return new


class Stragglers:
    """The agent's part for stragglers (see the module): :meth:`tick` from its main loop.
    With several nodes the store's part runs on a thread of its own: a store call to a
    host cut off never returns, and the agent's loop must go on (to judge the store lost,
    wait ``--store-wait`` and leave); while a round is out, ticks skip."""

    def __init__(self, agent: AgentPorts) -> None:
        self.agent = agent
        self.watch = StragglerWatch()
        self.links = Links(agent)
        self._next = 0.0
        self._written = ""
        self._rounds: queue.Queue[tuple[float, dict[int, Figures]]] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None

    def tick(self, now: float) -> None:
        a = self.agent
        cfg = a.config
        if cfg.stragglers == "off" or now < self._next:
            return
        self._next = now + EXCHANGE_S
        # (a draining node clears its figures: a stale one of a worker gone made its
        # peers look slow next to it, and they were replaced in turn until the job failed)
        mine = {} if a.draining is not None else self._mine()
        if cfg.nnodes == 1:
            self._round(now, mine)
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._exchanges, name="fastft-stragglers", daemon=True
            )
            self._thread.start()
        try:
            self._rounds.put_nowait((now, mine))
        except queue.Full:
            pass  # (the last round is still out: a silent store, the lease's to judge)

    def _exchanges(self) -> None:
        while True:
            now, mine = self._rounds.get()
            try:
                self._round(now, mine)
            except Exception:
                log.warning("stragglers: a round failed", exc_info=True)

    def _round(self, now: float, mine: dict[int, Figures]) -> None:
        a = self.agent
        cfg = a.config
        ranks_of: dict[int, list[int]] = {cfg.node_rank: sorted(mine)}
        members = self._exchange(mine, ranks_of) if cfg.nnodes > 1 else mine
        judge = members is not None and a.draining is None
        steps = {r: v[2:4] for r, v in members.items()} if members is not None else None
        self.links.tick(now, steps if judge else None, ranks_of)
        if members is None or not judge or self.links.holds(now):
            return  # not node 0 (it compares), the store did not answer, it drains, or a
            # link's probe is out or found one lately (the computes are not to be trusted)
        computes = {  # (a rank a probe took out is gone, whatever its node last wrote)
            r: (v[0], v[1]) for r, v in members.items() if r not in self.links.out
        }
        epochs = {r: v[4] for r, v in members.items()}
        for s in self.watch.newly(slow_members(computes, cfg.straggler_factor, epochs)):
            self._name(s)

    def _mine(self) -> dict[int, Figures]:
        """This node's live workers: rank -> (incarnation, compute, step time, seconds it
        has waited in the runtime, the epoch of those figures)."""
        out = {}
        now = time.monotonic()
        for slot in self.agent.slots.values():
            if slot.done or slot.proc is None or slot.proc.returncode is not None:
                continue
            hb = read_heartbeat(slot.heartbeat)
            if hb is not None and hb.last >= slot.started:
                waited = now - hb.waiting if hb.waiting else 0.0
                waited = waited if waited >= 1.0 else 0.0  # (a step's own waits: not news)
                out[slot.rank] = (slot.incarnation, hb.compute, hb.step, waited, int(hb.epoch))
        return out

    def _exchange(
        self, mine: dict[int, Figures], ranks_of: dict[int, list[int]]
    ) -> dict[int, Figures] | None:
        """Write this node's workers' figures; on node 0, read every node's (None
        elsewhere), and which node runs which ranks into ``ranks_of``."""
        a = self.agent
        cfg = a.config
        text = json.dumps(
            {str(r): [v[0], *(round(x, 6) for x in v[1:4]), v[4]] for r, v in mine.items()}
        )
        try:
            if text != self._written:
                a.store.set(a.keys.node_computes(cfg.node_rank), text)
                self._written = text
            if cfg.node_rank != 0:
                return None
            nodes = [n for n in range(cfg.nnodes) if n != cfg.node_rank]
            keys = [a.keys.node_computes(n) for n in nodes]
            got = dict(mine)
            if not a.store.check(keys):  # (one round trip; a node not started yet: later)
                return got
            for n, raw in zip(nodes, a.store.multi_get(keys), strict=True):
                theirs = json.loads(bytes(raw))
                ranks_of[n] = sorted(int(r) for r in theirs)
                for r, (inc, c, t, w, *e) in theirs.items():
                    got[int(r)] = (int(inc), float(c), float(t), float(w), int(e[0]) if e else 0)
            return got
        except Exception as e:  # (the store's loss is the node lease's to judge)
            log.warning("stragglers: could not exchange computes: %s", e)
            return None

    def _name(self, s: Slow) -> None:
        a = self.agent
        cfg = a.config
        replace = cfg.stragglers == "replace"
        a.events.emit(
            "straggler",
            rank=s.rank,
            incarnation=s.incarnation,
            compute_ms=round(s.compute_s * 1e3, 3),
            others_ms=round(s.others_s * 1e3, 3),
            ratio=round(s.ratio, 3),
            action="replace" if replace else "report",
        )
        what = (
            "asking it to drain; a spare or a restart takes its place"
            if replace
            else "--stragglers replace would replace it"
        )
        print(
            f"fastft: straggler: rank {s.rank} computes {s.ratio:.2f}x the others' median "
            f"({s.compute_s * 1e3:.0f} ms against {s.others_s * 1e3:.0f} ms a step, over its "
            f"last {RECENT_STEPS} steps; every step waits for it); {what}",
            file=sys.stderr,
            flush=True,
        )
        if not replace:
            return
        why = f"straggler: {s.ratio:.2f}x the others' compute (--stragglers replace)"
        self.mark(s.rank, s.incarnation, why)
        a.publish(DrainRequest(**a.header, target_rank=s.rank, reason=why))

    def mark(self, rank: int, incarnation: int, why: str) -> None:
        """``rank``'s life ``incarnation`` drains as a straggler: if it is this node's,
        its exit restarts the slot, and counts as a fault of it."""
        a = self.agent
        slot = a.slots.get(rank)
        if slot is None or slot.incarnation != incarnation or a.ledger.replaced(incarnation):
            return
        a.ledger.replace(incarnation)
        a.count_fault(rank, why)

    def on_message(self, m: Message) -> None:
        """A bus callback: a straggler's drain node 0's agent asked for (its reason says
        so), of a worker of this node."""
        self.links.on_message(m)
        if not isinstance(m, DrainRequest) or not m.reason.startswith("straggler:"):
            return
        slot = self.agent.slots.get(m.target_rank)
        if slot is not None:
            self.mark(m.target_rank, slot.incarnation, m.reason)
