"""The NATS control plane's lease beats on the scale model (issue 64): the project's
:class:`~fastft.launch.nodes.beats.Beats`, its messages core-NATS publishes and
subscriptions of the model's plane (:meth:`fastft.sim.costs.Plane.publish`). An agent's
clients are held to different servers (up to :data:`~fastft.launch.nodes.renewer.RENEWERS`)
and each subscribes to its watched nodes' subjects, as a real agent's do; its beats go out
on one of them, from the rounds (no renewer threads in simulated time)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from fastft.launch.nodes.beats import Beat, Beats, beat_subject, encode
from fastft.launch.nodes.renewer import RENEWERS
from fastft.sim.costs import Plane

__all__ = ["ModelBeats"]


class ModelBeats(Beats):
    """:class:`~fastft.launch.nodes.beats.Beats` on ``plane`` for the agent of ``node``
    (its clients' servers from ``home`` on)."""

    def __init__(
        self,
        plane: Plane,
        home: int,
        job: str,
        node: int,
        sign: Callable[[str, str], str],
        verify: Callable[[str, bytes], str | None],
        clock: Callable[[], float],
    ) -> None:
        super().__init__([], job, node, sign, verify, timeout_s=1.0, clock=clock)
        self.plane = plane
        n = len(plane.servers)
        self.servers = [plane.servers[(home + i) % n] for i in range(min(RENEWERS, n))]

    def sends(self) -> list[Callable[[], None]]:
        return []  # (the rounds beat: :meth:`fastft.launch.nodes.beatlease.BeatLease._renew`)

    def beat(self) -> None:
        with self._lock:
            self._counter += 1
            beat = Beat(self.node, self._counter, self._lives)
        subject = beat_subject(self.job, self.node)
        self.plane.publish(self.servers[0], subject, encode(beat, self.sign, subject))

    def declare(self, node: int, mark: str) -> None:
        subject = beat_subject(self.job, node)
        with self._lock:
            self._declared[node] = mark
        data = encode(Beat(node, 0, lost=mark), self.sign, subject)
        for server in self.servers:
            self.plane.publish(server, subject, data)

    def watch(self, nodes: list[int]) -> None:
        for n in sorted({self.node, *nodes} - self._subscribed):
            subject = beat_subject(self.job, n)
            for server in self.servers:
                self.plane.subscribe(server, subject, functools.partial(self._heard_msg, subject))
            self._subscribed.add(n)
