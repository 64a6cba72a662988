"""The NATS control plane's lease beats on the scale model (issue 64): the project's
:class:`~fastft.launch.nodes.beats.Beats`, its messages core-NATS publishes and
subscriptions of the model's plane (:meth:`fastft.sim.costs.Plane.publish`). An agent's
clients are held to different servers (up to :data:`~fastft.launch.nodes.renewer.RENEWERS`)
and each subscribes to its watched nodes' subjects, as a real agent's do; its beats go out
on one of them, from the rounds (no renewer threads in simulated time). A TCPStore job's
beats from agent to agent (:mod:`fastft.launch.nodes.peerbeats`): :class:`ModelPeerBeats`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fastft.launch.nodes.beats import Beat, Beats, beat_subject, encode
from fastft.launch.nodes.renewer import RENEWERS
from fastft.protocol.keys import JobKeys
from fastft.sim.costs import Plane

__all__ = ["ModelBeats", "ModelPeerBeats"]


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
        return []  # (no renewer threads: the scenario's renewer process calls renew())

    def beat(self) -> None:
        """Nothing from the rounds: a real agent's beats come from its renewer thread,
        which nothing the rounds wait for holds up (:meth:`renew`)."""

    def renew(self) -> None:
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


class ModelPeerBeats(Beats):
    """:class:`~fastft.launch.nodes.peerbeats.PeerBeats` on the model: a beat goes from
    agent to agent in half a round trip and costs the store nothing; a watcher's first
    watch of a node reads its address once (a request of the store's). ``peers``: every
    agent's, by node (the "network")."""

    def __init__(
        self,
        plane: Plane,
        store: Any,
        peers: dict[int, ModelPeerBeats],
        keys: JobKeys,
        node: int,
        sign: Callable[[str, str], str],
        verify: Callable[[str, bytes], str | None],
        clock: Callable[[], float],
    ) -> None:
        super().__init__([], keys.job, node, sign, verify, timeout_s=1.0, clock=clock)
        self.plane, self.store, self.peers, self.keys = plane, store, peers, keys
        self.watchers: list[ModelPeerBeats] = []
        peers[node] = self

    def listen(self) -> None:
        """Its server's address in the store (a real agent's beats start with its lease's
        rounds, after the lease made its keys)."""
        self.store.set(self.keys.node_beats(self.node), f"model:{self.node}")

    def sends(self) -> list[Callable[[], None]]:
        return []  # (no renewer threads: the scenario's renewer process calls renew())

    def _deliver(self, to: ModelPeerBeats, about: int, beat: Beat) -> None:
        subject = beat_subject(self.job, about)
        data = encode(beat, self.sign, subject)
        hub = self.plane.hub
        hub.at(hub.now + self.plane.c.rtt_s / 2, functools.partial(to._heard_msg, subject, data))

    def beat(self) -> None:
        """Nothing from the rounds (:meth:`renew`, as :class:`ModelBeats`')."""

    def renew(self) -> None:
        with self._lock:
            self._counter += 1
            beat = Beat(self.node, self._counter, self._lives)
        self.plane.ops["message"] += 1
        for w in self.watchers:
            self._deliver(w, self.node, beat)

    def declare(self, node: int, mark: str) -> None:
        with self._lock:
            self._declared[node] = mark
        to = self.watchers if node == self.node else [self.peers[node]]
        for w in to:
            self._deliver(w, node, Beat(node, 0, lost=mark))

    def watch(self, nodes: list[int]) -> None:
        for n in sorted(set(nodes) - self._subscribed - {self.node}):
            key = self.keys.node_beats(n)
            if not self.store.check([key]):  # (not started yet: the next round's watch)
                continue
            self.store.get(key)  # (its address, once)
            self.peers[n].watchers.append(self)
            self._subscribed.add(n)

    def silent_for(self) -> float:
        return 0.0
