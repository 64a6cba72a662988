"""Slow links, found by probing (issue 50, active identification): a node whose network
link is slow (a throttled port, a bad cable, a congested switch) makes every step wait in
its collectives, yet every member computes as fast as before, so the straggler check
(:mod:`fastft.launch.gray.stragglers`, which compares computes) names no one. Nothing passive
can: in a ring or tree every member waits for the same slowest link.

**When.** Node 0's agent asks for a probe round (i) once at the start, when every member
has :data:`~fastft.process.heartbeat.RECENT_STEPS` clean steps (a link slow from the
start has no faster past to compare with), and (ii) when the job's steps (commit to
commit, the median of the members') grow to ``--straggler-factor`` times the fastest the
job ran in this world (:class:`Slowdown`), and (iii) when every member is alive and has
waited in the runtime for :data:`STUCK_STEPS` step times, at least :data:`STUCK_FLOOR_S`
(a collective stuck with no one hung: the faults "with no clear culprit"); (ii) and (iii)
at most once per :data:`PROBE_EVERY_S` each.

**How.** Every agent of a multi-node job runs a probe server (a TCP port the OS picks on
the address it reaches the store from; ``node_probe`` in the store). In round ``r``
(``probe_round``) each agent sends :data:`PROBE_BYTES` to the next :data:`RING` nodes
around the ring in acknowledged chunks, for at most :data:`PROBE_BUDGET_S` (a slow link's
time is scaled up: the probe must not fill its queue), and writes the times
(``probe_result``). Off the step's path: the agents' threads, at most 256 KiB per link.

**Who is named** (:func:`slow_links`, pure): a node all of whose sends (or receipts) take
``--straggler-factor`` times the median of the pairs without it, by at least
:data:`MIN_EXTRA_S`: its link, in that direction. Two nodes cannot be told apart (every
pair involves both). Named: an event (``slow_link``), a line of node 0's agent, the
``fastft_stragglers_total`` metric, a row of ``fastft report``. With ``--stragglers
replace`` the node's workers are asked to drain and their slots quarantined (the node
leaves the job; an elastic world goes on without it, a fixed one waits for the operator):
a replacement on the same link would be as slow.

**Broken pairs** (:func:`broken_pairs`, pure): probes that fail (no chunk acknowledged
in :data:`PROBE_TIMEOUT_S`, twice) between two nodes that each reach others. No process
group can hold both; once a second round, asked at once, finds the same pairs, node 0's
agent takes one node out (killed and quarantined by its own agent: a drain would wait
for a commit the stuck collective never reaches), and an elastic world goes on.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastft.bus.tcpstore import address_toward
from fastft.launch.rules.linkjudge import (
    CHUNK,
    FAILED_S,
    PROBE_BUDGET_S,
    PROBE_BYTES,
    PROBE_EVERY_S,
    PROBE_TIMEOUT_S,
    PROBE_WAIT_S,
    QUIET_S,
    Broken,
    Slowdown,
    SlowLink,
    broken_pairs,
    probe_targets,
    slow_links,
    stuck,
)
from fastft.process.beat import RECENT_STEPS
from fastft.protocol import DrainRequest, Message

if TYPE_CHECKING:
    from fastft.launch.ports import AgentPorts

__all__ = ["Links", "probe"]

log = logging.getLogger(__name__)

_ACK = b"k"
_HEADER = struct.Struct("<Q")


def _serve(sock: socket.socket) -> None:
    """The probe server: read a length and that many bytes, acknowledge, close."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=_answer, args=(conn,), daemon=True).start()


def _answer(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(PROBE_TIMEOUT_S * 2)
        try:
            head = conn.recv(_HEADER.size, socket.MSG_WAITALL)
            left = min(_HEADER.unpack(head)[0], PROBE_BYTES) if len(head) == _HEADER.size else 0
            while left > 0:
                chunk = conn.recv(min(left, CHUNK), socket.MSG_WAITALL)
                if not chunk:
                    return
                left -= len(chunk)
                conn.sendall(_ACK)
        except (OSError, struct.error):
            pass


def probe(address: str, nbytes: int = PROBE_BYTES, timeout_s: float = PROBE_TIMEOUT_S) -> float:
    """Seconds to send ``nbytes`` to the probe server at ``address`` (HOST:PORT), chunk by
    acknowledged chunk; a slow link's probe stops after :data:`PROBE_BUDGET_S` and is
    scaled up to ``nbytes`` (a probe must not fill a slow link's queue: on a 4 Mbit/s
    link 512 KiB held the node's lease renewals back past the lease). :data:`FAILED_S`
    if no chunk is acknowledged (each may take ``timeout_s``)."""
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    sent = 0
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            s.settimeout(max(0.01, timeout_s - (time.monotonic() - start)))
            s.sendall(_HEADER.pack(nbytes))
            while sent < nbytes:
                n = min(CHUNK, nbytes - sent)
                s.sendall(bytes(n))
                if s.recv(1) != _ACK:
                    break
                sent += n
                if time.monotonic() - start >= PROBE_BUDGET_S:
                    break
    except (OSError, ValueError):
        pass
    took = time.monotonic() - start
    if sent == 0:
        return FAILED_S
    return min(took * nbytes / sent, FAILED_S / 10)


class Links:
    """The agent's part (see the module): :meth:`tick` from the straggler check's, every
    agent's; node 0's with every member's (step time, seconds waited in the runtime) and
    which node runs which ranks."""

    def __init__(self, agent: AgentPorts) -> None:
        self.agent = agent
        cfg = agent.config
        self.active = cfg.nnodes > 1 and cfg.stragglers != "off"
        self.slowdown = Slowdown(cfg.straggler_factor)
        self._sock: socket.socket | None = None
        self._store: Any = None
        self._answered = 0
        """The last round this node probed in."""
        self._pending: tuple[int, float, str] | None = None
        """Node 0: the round in flight (round, judged by, why)."""
        self._started = False
        self._next = 0.0
        self._stuck_next = 0.0
        self._suspect: Broken | None = None
        """A broken pair one round found: the next round, asked at once, must find it too."""
        self._confirm = ""
        self._quiet_until = 0.0
        self._step = 0.0
        self.out: set[int] = set()
        """The ranks node 0's agent took out for their node's link (not compared since)."""
        self._named: set[tuple[int, str]] = set()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()

    def tick(
        self,
        now: float,
        members: Mapping[int, tuple[float, float]] | None,
        ranks_of: Mapping[int, list[int]],
    ) -> None:
        if not self.active:
            return
        a = self.agent
        try:
            if self._sock is None:
                self._listen()
            got = bytes(a.store.compare_set(a.keys.probe_round, "", "")) or b"0"
            asked = int(got)
            if asked > self._answered:
                self._answered = asked
                threading.Thread(
                    target=self._probe, args=(asked,), name="fastft-probe", daemon=True
                ).start()
            if members is not None:
                self._judge(now, members, ranks_of)
        except Exception as e:  # (the store's loss is the node lease's to judge)
            log.warning("links: %s", e)

    def holds(self, now: float) -> bool:
        """Whether the straggler check waits: a probe round is out, or a link was found
        slow or broken lately. The members' computes are not to be trusted then: a
        collective in the step that does not wait in the runtime counts as compute, and a
        slow link lengthens it unevenly around the ring (rank 0 read 1.46x its peer's
        while node 2's link was throttled, and was replaced for it)."""
        return self._pending is not None or bool(self._confirm) or now < self._quiet_until

    def _listen(self) -> None:
        a = self.agent
        toward = a.config.store or a.config.control or "127.0.0.1:0"
        sock = socket.create_server((address_toward(toward), 0))
        threading.Thread(target=_serve, args=(sock,), name="fastft-probes", daemon=True).start()
        host, port = sock.getsockname()[:2]
        a.store.set(a.keys.node_probe(a.config.node_rank), f"{host}:{port}")
        self._sock = sock
        self._store = a.store.clone()

    def _probe(self, round_: int) -> None:
        """This node's probes of round ``round_`` (a thread of its own)."""
        a, store = self.agent, self._store
        me = a.config.node_rank
        times = {}
        for peer in probe_targets(me, a.config.nnodes):
            key = a.keys.node_probe(peer)
            try:
                if store.check([key]):
                    address = bytes(store.get(key)).decode()
                    t = probe(address)
                    if t >= FAILED_S:  # (once more: a loaded host's late accept is no cut)
                        t = probe(address)
                    times[str(peer)] = round(t, 6)
            except Exception as e:
                log.warning("links: could not probe node %d: %s", peer, e)
        try:
            store.set(a.keys.probe_result(round_, me), json.dumps(times))
        except Exception as e:
            log.warning("links: could not write the probe times: %s", e)

    def _judge(
        self,
        now: float,
        members: Mapping[int, tuple[float, float]],
        ranks_of: Mapping[int, list[int]],
    ) -> None:
        a = self.agent
        steps = {r: t for r, (t, _) in members.items()}
        self._step = statistics.median(steps.values()) if steps else 0.0
        why = self.slowdown.update(steps)
        if self._pending is not None:
            self._collect(now, ranks_of)
            return
        stuck_why = stuck(members)
        if self._confirm:
            why, self._confirm = f"{self._confirm} (confirming a broken pair)", ""
        elif stuck_why is not None and now >= self._stuck_next:
            why, self._stuck_next = stuck_why, now + PROBE_EVERY_S
        elif not self._started and steps and all(t > 0 for t in steps.values()):
            self._started, why = True, "the job's start"
        elif why is None or now < self._next:
            return
        else:
            self._next = now + PROBE_EVERY_S  # (the start's round spends none of it)
        asked = self._answered + 1
        a.store.set(a.keys.probe_round, str(asked))
        self._pending = (asked, now + PROBE_WAIT_S, why)
        a.events.emit("probe_round", round=asked, why=why)

    def _collect(self, now: float, ranks_of: Mapping[int, list[int]]) -> None:
        assert self._pending is not None
        a, (asked, by, why) = self.agent, self._pending
        keys = {n: a.keys.probe_result(asked, n) for n in range(a.config.nnodes)}
        if not a.store.check(list(keys.values())):
            if now < by:
                return
            keys = {n: k for n, k in keys.items() if a.store.check([k])}
        self._pending = None
        times = {}
        live = {n for n, ranks in ranks_of.items() if ranks}  # (a node taken out: not judged)
        for n, raw in zip(keys, a.store.multi_get(list(keys.values())), strict=True):
            for peer, t in json.loads(bytes(raw) or b"{}").items():
                if n in live and int(peer) in live:
                    times[(n, int(peer))] = float(t)
        a.events.emit(
            "probe_times", round=asked, times={f"{s}>{d}": t for (s, d), t in times.items()}
        )
        slow = slow_links(times, a.config.straggler_factor)
        if slow or broken_pairs(times) is not None:  # (the members' computes: see holds)
            self._quiet_until = now + max(QUIET_S, 3 * RECENT_STEPS * self._step)
        for link in slow:
            if (link.node, link.direction) not in self._named:
                self._named.add((link.node, link.direction))
                self._name(link, why, ranks_of.get(link.node, []))
        broken = broken_pairs(times)
        if broken is not None and broken == self._suspect:
            self._exclude(broken, why, ranks_of.get(broken.node, []))
            broken = None
        elif broken is not None:  # (a round that straddled a cut looks the same: again)
            self._confirm = why
        self._suspect = broken

    def _name(self, link: SlowLink, why: str, ranks: list[int]) -> None:
        a = self.agent
        replace = a.config.stragglers == "replace"
        a.events.emit(
            "slow_link",
            node=link.node,
            direction=link.direction,
            probe_ms=round(link.seconds * 1e3, 3),
            others_ms=round(link.others_s * 1e3, 3),
            ratio=round(link.ratio, 3),
            ranks=ranks,
            why=why,
            action="replace" if replace else "report",
        )
        what = (
            "its workers drain and their slots are quarantined (--stragglers replace)"
            if replace
            else "--stragglers replace would take it out of the job"
        )
        print(
            f"fastft: straggler: node {link.node}'s link {link.direction}: "
            f"{link.rate(link.seconds):.1f} MB/s, the others' {link.rate(link.others_s):.1f} "
            f"MB/s ({link.ratio:.1f}x slower; a probe after {why}); every step waits for it; "
            f"{what}",
            file=sys.stderr,
            flush=True,
        )
        if not replace:
            return
        reason = f"slow link: node {link.node}'s {link.direction} {link.ratio:.1f}x slower"
        self.out |= set(ranks)
        for rank in ranks:
            a.publish(DrainRequest(**a.header, target_rank=rank, reason=reason))
            self.on_message(DrainRequest(**a.header, target_rank=rank, reason=reason))

    def _exclude(self, broken: Broken, why: str, ranks: list[int]) -> None:
        """Take ``broken.node`` out: an elastic world goes on without it (the pair cannot
        meet in any process group); a fixed world cannot, and the job is told why."""
        a = self.agent
        pairs = ", ".join(f"{s} -> {d}" for s, d in broken.pairs)
        elastic = a.config.min_replicas is not None
        a.events.emit(
            "broken_link",
            pairs=[list(p) for p in broken.pairs],
            node=broken.node,
            ranks=ranks,
            why=why,
            action="exclude" if elastic else "report",
        )
        what = (
            f"taking node {broken.node} out (its workers stopped, their slots quarantined)"
            if elastic
            else "a fixed world cannot go on without either: fix the route, or run elastic"
        )
        print(
            f"fastft: broken link: node pairs {pairs} cannot reach each other while both "
            f"reach the others (a probe after {why}); {what}",
            file=sys.stderr,
            flush=True,
        )
        if not elastic:
            return
        reason = f"broken link: node pairs {pairs}; node {broken.node} taken out"
        self.out |= set(ranks)
        for rank in ranks:
            a.publish(DrainRequest(**a.header, target_rank=rank, reason=reason))
            self.on_message(DrainRequest(**a.header, target_rank=rank, reason=reason))

    def on_message(self, m: Message) -> None:
        """A bus callback: node 0's agent takes a worker of this node out for its link:
        its slot is quarantined (a replacement on the same link would be as slow); one
        taken out for a broken link is stopped now (it may be stuck in a collective)."""
        if not isinstance(m, DrainRequest) or not m.reason.startswith(("slow link:", "broken")):
            return
        a = self.agent
        slot = a.slots.get(m.target_rank)
        if slot is None or not a.offenders.quarantine(m.target_rank, m.reason):
            return
        a.events.emit("quarantined", rank=m.target_rank, reason=m.reason)
        print(f"fastft: quarantine: rank {m.target_rank}: {m.reason}", file=sys.stderr, flush=True)
        if m.reason.startswith("broken") and slot.proc is not None and not slot.done:
            a.children.kill(slot, signal.SIGKILL, incarnation=slot.incarnation)
