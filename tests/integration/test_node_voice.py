"""One voice per node over the real parts (issue 64): workers under a bus relay hand their
arrivals to their agent's voice (fastft.launch.nodes.voice), which writes them together on
a real TCPStore with the job secret and waits for the closed epoch once for the node; a
malformed request is counted and dropped; a worker whose agent does not answer writes its
own arrival."""

from __future__ import annotations

import threading

import pytest

from fastft.bus import BusConfig, RelayHub, host_store, node_voice, open_bus
from fastft.bus.signed import SignedStore
from fastft.launch.nodes.voice import AgentVoice
from fastft.protocol import JobKeys
from fastft.protocol.auth import JobSecret, ValueAuth
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.survivors import Survivors
from fastft.testing import wait_for

pytestmark = pytest.mark.timeout(60)
JOB = "voice-test"


class Node:
    """A real TCPStore, a node's relay hub, and its workers' bus endpoints through it."""

    def __init__(self) -> None:
        self.store = host_store()
        self.hub = RelayHub().start()
        self.endpoints: list = []

    def worker(self, rank: int):
        cfg = BusConfig(job=JOB, rank=rank, incarnation=rank + 100)
        self.endpoints.append(open_bus(self.store, cfg, relay=self.hub.address).start())
        return self.endpoints[-1]

    def close(self) -> None:
        for ep in self.endpoints:
            ep.close()
        self.hub.close()


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def _signed(store, keys: JobKeys) -> SignedStore:
    return SignedStore(store, keys, ValueAuth(JobSecret(b"v" * 32)))


def _arrive_all(node: Node, ranks: list[int], keys: JobKeys) -> dict[int, bool]:
    prev = EpochView(1, tuple(Member(r, 1) for r in range(4)), 0, frozenset(), None)
    firsts: dict[int, bool] = {}
    coords = {}
    for r in ranks:
        c = Coordinator(_signed(node.store.clone(), keys), keys, r, 1, 4, 3)
        c.voice = node_voice(node.worker(r))
        assert c.voice is not None
        coords[r] = c

    def arrive(r: int) -> None:
        w = Survivors(coords[r]).arrive(prev, frozenset({0}), step=7, lost_state=False, timeout_s=2)
        firsts[r] = w.first

    threads = [threading.Thread(target=arrive, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return firsts


def test_the_agent_writes_its_workers_arrivals_together_and_waits_for_them(node):
    keys = JobKeys(JOB)
    voice = AgentVoice(node.hub, _signed(node.store, keys), keys, lambda: 3).start()
    try:
        firsts = _arrive_all(node, [1, 2, 3], keys)
        assert sorted(firsts) == [1, 2, 3] and sum(firsts.values()) == 1 and firsts[1]
        assert voice.written == 3 and voice.bad == 0
        signed = _signed(node.store.clone(), keys)
        assert int(signed.add(keys.epoch_arrivals(2), 0)) == 3  # (one add of 3)
        assert b'"step": 7' in signed.get(keys.epoch_arrival(2, 3))  # (signed, checked)
        # the closed epoch, waited for by the agent once for the node's waiters
        ports = [node_voice(node.worker(r)) for r in (5, 6)]
        got: list[tuple[bool, bytes | None]] = []
        waiters = [threading.Thread(target=lambda p=p: got.append(p.closed(2, 5.0))) for p in ports]
        for t in waiters:
            t.start()
        signed.set(keys.epoch_change(2), '{"change": 1}')
        for t in waiters:
            t.join(10)
        assert got == [(True, b'{"change": 1}')] * 2
        # a wait that runs out is said to be one (the worker looks itself)
        assert ports[0].closed(3, 0.2) == (True, None)
    finally:
        voice.stop()


def test_a_malformed_request_is_counted_and_dropped(node):
    keys = JobKeys(JOB)
    voice = AgentVoice(node.hub, _signed(node.store, keys), keys, lambda: 1).start()
    try:
        port = node_voice(node.worker(1))
        assert port.t.send_up(b"not json")
        assert port.t.send_up(b'{"op": "arrive", "epoch": 2, "rank": 1, "arrival": "x"}')
        assert wait_for(lambda: voice.bad == 2, 5.0)
        assert voice.written == 0
    finally:
        voice.stop()


def test_a_worker_whose_agent_has_no_voice_writes_its_own_arrival(node):
    keys = JobKeys(JOB)  # (no AgentVoice: nothing answers the hub's frames)
    firsts = _arrive_all(node, [2], keys)
    assert firsts == {2: True}
    assert _signed(node.store.clone(), keys).check([keys.epoch_arrival(2, 2)])
