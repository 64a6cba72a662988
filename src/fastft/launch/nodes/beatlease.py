"""A node's lease on the NATS control plane: the counters are core-NATS beats
(:mod:`fastft.launch.nodes.beats`), not the bucket's. The marks are read from the bucket
by a thread of their own (a read that waits for a leader election holds up no lease), and
a declaration goes out on the beats' subject before its mark is written."""

from __future__ import annotations

import logging
import threading
from typing import Any

from fastft.launch.nodes.beats import Beats
from fastft.launch.nodes.lease import NodeLease
from fastft.launch.rules.leasewatch import DONE, watched
from fastft.launch.rules.lives import lost_mark, mark_counter, put_mark

__all__ = ["BeatLease"]

log = logging.getLogger(__name__)


class BeatLease(NodeLease):
    """:class:`~fastft.launch.nodes.lease.NodeLease` with beats (``beats``; the other
    arguments are its)."""

    ROUNDS_ANSWER = False

    def __init__(self, *args: Any, beats: Beats, **kwargs: Any) -> None:
        self.beats = beats
        self._own_mark = self._failed = ""
        """This node's lost mark and the job's failed mark, as last read."""
        super().__init__(*args, **kwargs)

    def _sends(self, store: Any, renewers: int) -> list[Any]:
        return self.beats.sends()

    def start(self) -> BeatLease:
        self.beats.watch(watched(self.node, self.nnodes, {}, self.watchers))
        threading.Thread(target=self._marks, name="fastft-lease-marks", daemon=True).start()
        super().start()
        return self

    def say_done(self) -> None:
        """With beats: tell the watchers this node is done before its beats stop (its
        done mark in the bucket is read a round later)."""
        self.beats.declare(self.node, DONE)

    def set_lives(self, lives: dict[int, int]) -> None:
        """This node's worker lives, which its beats carry (with beats)."""
        self.beats.set_lives(lives)

    def _marks(self) -> None:
        """With beats: read the watched nodes' marks, this node's own and the job's failed
        mark from the bucket every heartbeat, on a thread of its own (a read that waits for
        a leader election holds up no lease). The bucket failing every read for the
        store's grace loses the store, as a round's failures would."""
        ok = self.clock()
        while not self._stop.wait(self.config.period_s):
            nodes = watched(self.node, self.nnodes, self.marks, self.watchers)
            keys = [self.keys.node_lost(n) for n in nodes]
            try:
                got = self.store.multi_get(
                    [*keys, self.keys.node_lost(self.node), self.keys.failed]
                )
            except Exception as e:
                silent = self.clock() - ok
                if silent >= self.config.grace_s:
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    self._lost_store(f"no answer for {silent * 1000:.0f} ms: {why}")
                continue
            ok = self._answered = self.clock()
            self._store_back()
            text = [bytes(v).decode(errors="replace") for v in got]
            self.marks = dict(zip(nodes, text[:-2], strict=True))
            self._own_mark, self._failed = text[-2], text[-1]

    def _read(self) -> tuple[dict[int, int], str, str]:
        """One round's read with beats: the counters heard (none read: no round trip), the
        marks as :meth:`_marks` last read them. Raises if no beat was heard for a lease,
        not even this node's own: this agent is the one cut off, and blames nobody."""
        nodes = watched(self.node, self.nnodes, self.marks, self.watchers)
        self.beats.watch(nodes)
        silent = self.beats.silent_for()
        if silent > self.config.lease_s:
            raise TimeoutError(
                f"heard no beat for {silent * 1000:.0f} ms, not even this node's own "
                "(this node cut off from every NATS server)"
            )
        return self.beats.counters(nodes), self._own_mark, self._failed

    def _declare(self, node: int) -> None:
        """With beats: unless another watcher declared this stop of the node already, tell
        the others, declare its workers dead (the lives its last beat carried) and write
        the mark when the bucket answers (the node's fence when it returns)."""
        counter = self.watch.counter(node)
        heard = self.beats.declared(node)
        if heard == DONE or (heard and mark_counter(heard) >= counter):
            return  # (done, or declared by another watcher)
        lives = self.beats.lives(node)
        mark = lost_mark(counter, self.node, lives)
        self.beats.declare(node, mark)
        self.on_lost(node, lives, counter)
        threading.Thread(
            target=self._write_mark, args=(node, mark), name="fastft-lost-mark", daemon=True
        ).start()

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
