"""One voice per node (issue 64): a node's agent writes its workers' arrivals together and
waits for the closed epoch once for the node (runtime/engine/voice.py), on the real
survivors over a store in a dict, and in the scale model."""

from __future__ import annotations

import pytest

from fastft.protocol.keys import JobKeys
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.formation import Arrival
from fastft.runtime.engine.survivors import Survivors
from fastft.runtime.engine.voice import WINDOW_S, Batches, NodeVoice
from fastft.sim import scale
from fastft.sim.store import SimStore

pytestmark = pytest.mark.timeout(300)


def test_a_batch_goes_out_when_the_node_is_in_or_its_window_ran_out():
    b = Batches()
    assert b.add(2, 8, "a8", 0.0, expected=3) is None
    assert b.add(2, 9, "a9", 0.001, expected=3) is None
    got = b.add(2, 10, "a10", 0.002, expected=3)
    assert got is not None and sorted(got.arrivals) == [8, 9, 10] and not b.open
    # one worker hangs: the window writes the others
    assert b.add(3, 8, "a8", 1.0, expected=3) is None
    assert b.due(1.0 + WINDOW_S / 2) == []
    assert b.next_due() == pytest.approx(1.0 + WINDOW_S)
    (late,) = b.due(1.0 + WINDOW_S)
    assert sorted(late.arrivals) == [8]
    # the rest of that epoch: written as it comes once the node's count is reached
    assert b.add(3, 9, "a9", 1.1, expected=3) is None
    assert b.add(3, 10, "a10", 1.1, expected=3) is not None


class _Port:
    """A worker's voice over a NodeVoice on the same store (the agent's part, at once)."""

    def __init__(self, voice: NodeVoice) -> None:
        self.voice = voice
        self.batches = Batches()
        self.answer: dict[int, bool] = {}

    def arrive(self, epoch: int, rank: int, arrival: str) -> bool | None:
        batch = self.batches.add(epoch, rank, arrival, 0.0, expected=1)
        assert batch is not None
        return self.voice.write(batch) == rank

    def closed(self, epoch: int, timeout_s: float) -> tuple[bool, bytes | None]:
        return True, self.voice.wait_change(epoch, 0.0)


def _coord(store: SimStore, r: int, n: int) -> Coordinator:
    keys = JobKeys("voice")
    return Coordinator(store, keys, r, 1, n, n, clock=lambda: 0.0, sleep=lambda s: None)


def test_the_agent_writes_the_keys_and_count_a_worker_would():
    prev = EpochView(1, tuple(Member(r, 1) for r in range(4)), 0, frozenset(), None)
    direct, voiced = SimStore(), SimStore()
    for store, via in ((direct, False), (voiced, True)):
        for r in (1, 2):
            c = _coord(store, r, 4)
            if via:
                c.voice = _Port(NodeVoice(store, c.keys))
            w = Survivors(c).arrive(prev, frozenset({0}), step=5, lost_state=False, timeout_s=1)
            assert w.first == (r == 1)
    assert direct.kv == voiced.kv
    got = Arrival.from_json(voiced.kv[JobKeys("voice").epoch_arrival(2, 2)])
    assert (got.incarnation, got.step, got.lost) == (1, 5, False)


def test_a_worker_whose_agent_does_not_answer_writes_its_arrival_itself():
    class Gone:
        def arrive(self, epoch, rank, arrival):
            return None

        def closed(self, epoch, timeout_s):
            return False, None

    prev = EpochView(1, tuple(Member(r, 1) for r in range(2)), 0, frozenset(), None)
    store = SimStore()
    c = _coord(store, 1, 2)
    c.voice = Gone()
    w = Survivors(c).arrive(prev, frozenset({0}), step=3, lost_state=False, timeout_s=1)
    assert w.first and JobKeys("voice").epoch_arrival(2, 1) in store.kv


@pytest.mark.parametrize("plane", ["tcpstore", "nats"])
def test_with_a_voice_per_node_the_servers_see_nodes_not_ranks(plane):
    with scale.memo():
        alone = scale.reform(1024, plane, voice=False)
        voiced = scale.reform(1024, plane, voice=True)
    assert voiced.done_s is not None and voiced.errors == 0
    assert voiced.closers == 1 and voiced.false_deaths == 0 and voiced.repolls == 0
    # 8 workers a node: ~4 requests a node instead of ~4-7 a member
    assert voiced.requests_per_member <= alone.requests_per_member / 4
    assert voiced.done_s < alone.done_s
