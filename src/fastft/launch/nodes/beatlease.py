"""A node's lease on the NATS control plane: the counters are core-NATS beats
(:mod:`fastft.launch.nodes.beats`), not the bucket's. The marks are read from the bucket
by a thread of their own (a read that waits for a leader election holds up no lease), and
a declaration goes out on the beats' subject before its mark is written.

The bucket's marks are the durable record, read as a backstop: every round in a job of up
to :data:`MARKS_READS_PER_S` x the heartbeat nodes (100 at 100 ms), less often above, so
that the job's agents read them :data:`MARKS_READS_PER_S` times a second in all (every
2 s at 2,048 nodes: a read every round was 20,480 a second, ~7.6 s of the servers' work
a second). What must act at once travels with the beats: a watcher's declaration (the
node's own agent fences on hearing it; its other watchers do not declare again) and a
node's end (:meth:`BeatLease.say_done`). What waits for the backstop: a watcher moving
past a lost node on the ring, and another node's failure of the job (its workers' faults
travel on the bus meanwhile)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from fastft.launch.nodes.beats import Beats
from fastft.launch.nodes.lease import NodeLease
from fastft.launch.rules.leasewatch import DONE, held_after_return, watched
from fastft.launch.rules.lives import lost_mark, mark_counter, put_mark

__all__ = ["MARKS_READS_PER_S", "BeatLease", "marks_every"]

log = logging.getLogger(__name__)

MARKS_READS_PER_S = 1000.0
"""The job's reads of the bucket's marks a second, in all (each ~0.37 ms of a server: 5
keys, :mod:`fastft.sim.calibration`), once it has more nodes than that many heartbeats."""


def _thread(name: str, fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name=name, daemon=True).start()


def marks_every(period_s: float, nnodes: int) -> float:
    """How often one agent reads the bucket's marks: every round, or every
    ``nnodes / MARKS_READS_PER_S`` seconds in a larger job."""
    return max(period_s, nnodes / MARKS_READS_PER_S)


class BeatLease(NodeLease):
    """:class:`~fastft.launch.nodes.lease.NodeLease` with beats (``beats``; the other
    arguments are its)."""

    ROUNDS_ANSWER = False

    def __init__(
        self,
        *args: Any,
        beats: Beats,
        spawn: Callable[[str, Callable[[], None]], None] | None = None,
        **kwargs: Any,
    ) -> None:
        self.beats = beats
        self._spawn = spawn or _thread
        """Runs work that may wait long (a mark's write) off the rounds (a thread; the
        scale model's: a process in simulated time)."""
        self._own_mark = self._failed = ""
        """This node's lost mark and the job's failed mark, as last read."""
        super().__init__(*args, **kwargs)

    def _sends(self, store: Any, renewers: int) -> list[Any]:
        return self.beats.sends()

    def _doubted(self) -> None:
        """The store did not answer a marks read (:class:`~fastft.launch.nodes.peerbeats.
        PeerLease` then doubts what it heard; NATS's beats say for themselves)."""

    @property
    def answers_every(self) -> float:
        return marks_every(self.config.period_s, self.nnodes)

    def start(self) -> BeatLease:
        self.beats.watch(watched(self.node, self.nnodes, {}, self.watchers))
        threading.Thread(
            target=self.marks_rounds, args=(self._stop,), name="fastft-lease-marks", daemon=True
        ).start()
        super().start()
        return self

    def _renew(self) -> None:
        """Beat in the round (without clients of their own for a
        :class:`~fastft.launch.nodes.renewer.Renewer`: the scale model's)."""
        if self._renewer is None:
            self.beats.beat()
            self._renewals += 1

    def say_done(self) -> None:
        """With beats: tell the watchers this node is done before its beats stop (its
        done mark in the bucket is read a round later)."""
        self.beats.declare(self.node, DONE)

    def set_lives(self, lives: dict[int, int]) -> None:
        """This node's worker lives, which its beats carry (with beats)."""
        self.beats.set_lives(lives)

    def marks_rounds(self, stop: Any) -> None:
        """Read the watched nodes' marks, this node's own and the job's failed mark from
        the bucket every :func:`marks_every` until ``stop.is_set()`` (waiting with
        ``stop.wait(s)``), on a thread of its own: a read that waits for a leader election
        holds up no lease. The bucket failing every read for the store's grace loses the
        store, as a round's failures would."""
        ok = self.clock()
        failed = 0
        every = marks_every(self.config.period_s, self.nnodes)
        while not stop.wait(every):
            nodes = watched(self.node, self.nnodes, self.marks, self.watchers)
            keys = [self.keys.node_lost(n) for n in nodes]
            began = self.clock()
            try:
                for n in nodes:  # (a node newly watched: its mark may not exist yet, and a
                    if n not in self.marks:  # read of a missing key waits for it)
                        self.store.compare_set(self.keys.node_lost(n), "", "")
                got = self.store.multi_get(
                    [*keys, self.keys.node_lost(self.node), self.keys.failed]
                )
                if self.clock() - began > self.config.lease_s:
                    self._doubted()  # (it waited for this agent's own link, likely)
            except Exception as e:
                failed += 1
                self._doubted()
                silent = self.clock() - ok
                if failed >= 2 and silent >= self.config.grace_s:  # (one read is no verdict)
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    self._lost_store(f"no answer for {silent * 1000:.0f} ms: {why}")
                continue
            failed = 0
            ok = self._answered = self.clock()
            self._store_back()
            text = [bytes(v).decode(errors="replace") for v in got]
            self.marks = dict(zip(nodes, text[:-2], strict=True))
            self._own_mark, self._failed = text[-2], text[-1]

    def _read(self) -> tuple[dict[int, int], str, str]:
        """One round's read with beats: the counters heard (none read: no round trip), the
        marks as :meth:`marks_rounds` last read them. Raises if no beat was heard for a lease,
        not even this node's own: this agent is the one cut off, and blames nobody."""
        nodes = watched(self.node, self.nnodes, self.marks, self.watchers)
        self.beats.watch(nodes)
        silent = self.beats.silent_for()
        if silent > self.config.lease_s:
            raise TimeoutError(
                f"heard no beat for {silent * 1000:.0f} ms, not even this node's own "
                "(this node cut off from every NATS server)"
            )
        # (a declaration of this node heard on its subject: fenced now, not at the read)
        heard = self.beats.declared(self.node)
        own = self._own_mark or ("" if heard == DONE else heard)
        return self.beats.counters(nodes), own, self._failed

    def _fence(self, mark: str) -> None:
        if mark not in self._fenced:
            self.beats.fenced()
        super()._fence(mark)

    def _declare(self, node: int) -> None:
        """With beats: unless another watcher declared this stop of the node already, tell
        the others, declare its workers dead (the lives its last beat carried) and write
        the mark when the bucket answers (the node's fence when it returns)."""
        b = self.beats
        if held_after_return(
            self.clock(), b.own_at(), b.back_at, b.back_gap, b.heard_at(node), self.config.lease_s
        ):
            self.watch.lost.discard(node)  # (this node may be the one cut off: judged later)
            return
        counter = self.watch.counter(node)
        heard = self.beats.declared(node)
        if heard == DONE or (heard and mark_counter(heard) >= counter):
            return  # (done, or declared by another watcher)
        lives = self.beats.lives(node)
        mark = lost_mark(counter, self.node, lives)
        self.beats.declare(node, mark)
        self.on_lost(node, lives, counter)
        self._spawn("fastft-lost-mark", functools.partial(self._write_mark, node, mark))

    def _write_mark(self, node: int, mark: str) -> None:
        deadline = self.clock() + 60.0  # (a leader election takes seconds, not minutes)
        while not self._stop.is_set() and self.clock() < deadline:
            try:
                put_mark(self.store, self.keys, node, mark)
                return
            except Exception as e:
                log.debug("node %d: its lost mark not written yet: %s", node, e)
                self._stop.wait(self.config.period_s)
        log.warning("node %d: could not write its lost mark (it is not fenced if it returns)", node)
