"""Node leases as core-NATS beats (issue 60, case 5), on the NATS control plane.

A lease counter kept in the key-value bucket is a JetStream write: it waits for the
stream's leader, and when the leader's server is the one cut off, every node stops renewing
until a new leader is elected (seconds). So the lease needed 3 s on NATS, and a node cut
was declared after 3.1-8.8 s. Here each agent publishes its lease counter as a signed core
message on the node's subject (``fastft.<job>.beat.<node>``), on clients of its own held
to different servers (:func:`fastft.bus.natsio.pinned`), each renewal on whichever one is
idle (:class:`~fastft.launch.nodes.renewer.Renewer`); its watchers subscribe through every one
of theirs. No beat waits for a leader, and a server cut off is only one path of several:
the lease is 300 ms on NATS as on a TCPStore.

A beat carries the node's worker lives, so that a watcher declares the node's workers dead
at once (on the bus, also core NATS) without reading the bucket; the durable lost mark is
written after, when the bucket answers. The declaring watcher publishes the mark on the
node's subject too: the other watchers of that node hear it and do not declare again. A
watcher that hears no beat at all, not even its own, is the one cut off: it declares
nobody. A beat without the job secret's tag is counted and dropped (:attr:`Beats.forged`);
a replayed one carries a counter already seen and moves nothing.

:func:`encode` and :func:`decode` are pure; :class:`Beats` is the I/O around them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastft.launch.rules.lives import format_lives, parse_lives

__all__ = ["Beat", "Beats", "beat_subject", "decode", "encode"]

log = logging.getLogger(__name__)


def beat_subject(job: str, node: int) -> str:
    """The core-NATS subject of ``node``'s beats (and of the marks declaring it lost)."""
    safe = "".join(c if c.isalnum() or c in "_-" else f"={ord(c):02X}" for c in job)
    return f"fastft.{safe}.beat.{node}"


@dataclass(frozen=True)
class Beat:
    """One message on a node's subject: its lease ``counter`` and worker ``lives`` (a
    beat), or a watcher's ``lost`` mark (:func:`fastft.launch.rules.lives.lost_mark`) for it."""

    node: int
    counter: int
    lives: dict[int, int] = field(default_factory=dict)
    lost: str = ""


def encode(beat: Beat, sign: Callable[[str, str], str], subject: str) -> bytes:
    text = f"{beat.node} {beat.counter} {format_lives(beat.lives) or '-'} {beat.lost or '-'}"
    return sign(subject, text).encode()


def decode(raw: bytes, verify: Callable[[str, bytes], str | None], subject: str) -> Beat | None:
    """The beat, or None if it carries no valid tag or is malformed."""
    text = verify(subject, raw)
    if text is None:
        return None
    parts = text.split(" ")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    lives = {} if parts[2] == "-" else parse_lives(parts[2])
    return Beat(int(parts[0]), int(parts[1]), lives, "" if parts[3] == "-" else parts[3])


class Beats:
    """This agent's beats and what it hears of its own and its watched nodes' (see the
    module). ``conns``: nats-py clients on the process's NATS loop; ``sign``/``verify``:
    the job's value signature (:class:`fastft.protocol.auth.ValueAuth`)."""

    def __init__(
        self,
        conns: list[Any],
        job: str,
        node: int,
        sign: Callable[[str, str], str],
        verify: Callable[[str, bytes], str | None],
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conns = conns
        self.job = job
        self.node = node
        self.sign = sign
        self.verify = verify
        self.timeout_s = timeout_s
        self.clock = clock
        self.forged = 0
        """Messages on a watched subject without the job secret's tag (dropped)."""
        self._lock = threading.Lock()
        self._counter = 0
        self._lives: dict[int, int] = {}
        self._heard: dict[int, tuple[int, dict[int, int]]] = {}
        """node -> (the highest counter heard, the lives its beat carried)."""
        self._declared: dict[int, str] = {}
        """node -> the newest lost mark heard for it."""
        self._last_any = clock()
        self._last_own = clock()
        self.back_at = 0.0
        """When this node's own beats were heard again after a gap (it was cut off: what it
        hears of the others may still be in retransmission)."""
        self.back_gap = 0.0
        """How long that gap lasted (s)."""
        self._heard_at: dict[int, float] = {}
        """node -> when a new counter of it was last heard."""
        self._subscribed: set[int] = set()

    # --- sending ---------------------------------------------------------------------------
    def set_lives(self, lives: dict[int, int]) -> None:
        with self._lock:
            self._lives = dict(lives)

    def sends(self) -> list[Callable[[], None]]:
        """One blocking renewal per client (for :class:`~fastft.launch.nodes.renewer.Renewer`)."""
        return [functools.partial(self._send, nc) for nc in self.conns]

    def beat(self) -> None:
        """One beat now, on the first client (the rounds' own, without a renewer)."""
        self._send(self.conns[0])

    def _send(self, nc: Any) -> None:
        from fastft.bus.natsio import run

        if not nc.is_connected:  # (reconnecting: a publish there waits in a buffer, and its
            raise ConnectionError("reconnecting")  # flush returns at once: no beat out)
        with self._lock:
            self._counter += 1
            beat = Beat(self.node, self._counter, self._lives)
        subject = beat_subject(self.job, self.node)
        data = encode(beat, self.sign, subject)

        async def publish() -> None:
            await nc.publish(subject, data)
            await nc.flush(timeout=self.timeout_s)  # (the server has it: this client is idle)

        run(publish(), self.timeout_s + 0.5)

    def declare(self, node: int, mark: str) -> None:
        """Tell ``node``'s other watchers that this agent declared it lost (``mark``), on
        every client, without waiting."""
        from fastft.bus.natsio import run

        subject = beat_subject(self.job, node)
        data = encode(Beat(node, 0, lost=mark), self.sign, subject)
        with self._lock:
            self._declared[node] = mark

        async def publish() -> None:
            for nc in self.conns:
                try:
                    await nc.publish(subject, data)
                except Exception as e:  # (a closed client; the others carry it)
                    log.debug("nats: a lost mark not sent on one client: %s", e)

        try:
            run(publish(), 1.0)
        except Exception as e:
            log.warning("could not tell node %d's other watchers it was declared: %s", node, e)

    # --- hearing ---------------------------------------------------------------------------
    def watch(self, nodes: list[int]) -> None:
        """Subscribe (through every client) to the beats of ``nodes`` and this node's own."""
        from fastft.bus.natsio import run

        new = [n for n in {self.node, *nodes} if n not in self._subscribed]
        if not new:
            return

        async def subscribe() -> None:
            for n in new:
                subject = beat_subject(self.job, n)

                async def on_msg(msg: Any, subject: str = subject) -> None:
                    self._heard_msg(subject, msg.data)

                for nc in self.conns:
                    await nc.subscribe(subject, cb=on_msg)

        run(subscribe(), self.timeout_s + 2.0)
        self._subscribed.update(new)

    def _heard_msg(self, subject: str, raw: bytes) -> None:
        beat = decode(raw, self.verify, subject)
        if beat is None or beat_subject(self.job, beat.node) != subject:
            with self._lock:
                self.forged += 1
                n = self.forged
            if n == 1 or n % 100 == 0:
                log.error(
                    "a beat on %s without the job secret's tag (%d so far): dropped", subject, n
                )
            return
        with self._lock:
            if beat.lost:
                self._declared[beat.node] = beat.lost
                return
            now = self.clock()
            self._last_any = now
            if beat.node == self.node:  # (its own beat back after a gap: this node was cut)
                gap = now - self._last_own
                if gap > self.timeout_s * 2 / 3:  # (2 of 3 beats)
                    self._cut_off(now, gap)
                self._last_own = now
            old = self._heard.get(beat.node)
            if old is None or beat.counter > old[0]:
                self._heard[beat.node] = (beat.counter, beat.lives)
                self._heard_at[beat.node] = now

    def counters(self, nodes: list[int]) -> dict[int, int]:
        """The highest counter heard from each of ``nodes`` (0: none yet)."""
        with self._lock:
            return {n: self._heard.get(n, (0, {}))[0] for n in nodes}

    def _cut_off(self, now: float, gap: float) -> None:
        """This node was cut off for ``gap`` s until ``now`` (under the lock). A hold that
        runs still (:func:`~fastft.launch.rules.leasewatch.held_after_return`) is not cut
        short: a node whose connections come back one by one hears its own beats, loses
        them again, and the second gap is shorter than the first."""
        left = self.back_at + self.back_gap - now if self.back_at else 0.0
        self.back_at, self.back_gap = now, max(gap, left)

    def fenced(self) -> None:
        """This node learned it was declared lost (it was cut off, for at least a lease):
        what it hears of the others is judged as after a return."""
        with self._lock:
            self._cut_off(self.clock(), self.timeout_s)

    def heard_at(self, node: int) -> float:
        """When a new counter of ``node`` was last heard (0: never)."""
        with self._lock:
            return self._heard_at.get(node, 0.0)

    def own_at(self) -> float:
        """When this node's own beat was last heard (its start, before the first)."""
        with self._lock:
            return self._last_own

    def lives(self, node: int) -> dict[int, int]:
        """The worker lives ``node``'s newest beat carried."""
        with self._lock:
            return dict(self._heard.get(node, (0, {}))[1])

    def silent_for(self) -> float:
        """Seconds since any beat was heard, this node's own included (this agent cut off
        from every server, when it grows past a lease)."""
        with self._lock:
            return self.clock() - self._last_any

    def declared(self, node: int) -> str:
        """The newest lost mark heard (or sent) for ``node``; "" if none."""
        with self._lock:
            return self._declared.get(node, "")
