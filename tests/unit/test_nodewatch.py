"""The agent's fence (issue 50): when its node was declared lost (a cut link, a stop), it
kills the worker lives the verdict named, never a newer life that started while the node
was cut off (it lost the store, exited, and was restarted: it joins as a new life)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from fastft.launch.nodes.nodewatch import NodeWatch
from fastft.launch.rules.ledger import Ledger
from fastft.launch.rules.lives import lost_mark


@dataclass
class _Slot:
    rank: int
    incarnation: int
    done: bool = False


@dataclass
class _Children:
    killed: list[tuple[int, int | None]] = field(default_factory=list)

    def kill(self, slot: Any, sig: int = 9, incarnation: int | None = None) -> None:
        self.killed.append((slot.rank, incarnation))


@dataclass
class _Events:
    got: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def emit(self, name: str, **fields: Any) -> None:
        self.got.append((name, fields))


class _Agent:
    def __init__(self, slots: dict[int, _Slot]) -> None:
        self.slots = slots
        self.children = _Children()
        self.events = _Events()
        self.ledger = Ledger(slots)


def test_the_fence_kills_the_lives_the_verdict_named_and_spares_newer_ones():
    agent = _Agent({2: _Slot(2, 9), 3: _Slot(3, 15), 4: _Slot(4, 0)})
    # the verdict named rank 2's life 9 and rank 3's life 4; rank 3 was restarted since
    NodeWatch(agent).fenced(lost_mark(41, 0, {2: 9, 3: 4}))  # type: ignore[arg-type]
    assert agent.children.killed == [(2, 9)]
    assert agent.ledger.fenced(9) and not agent.ledger.fenced(15)
    spared = [f for name, f in agent.events.got if name == "fence_spared"]
    assert spared == [{"rank": 3, "incarnation": 15, "declared": 4}]


def test_a_mark_that_names_no_lives_fences_every_running_worker():
    agent = _Agent({2: _Slot(2, 9), 3: _Slot(3, 15, done=True)})
    NodeWatch(agent).fenced("41@0")  # type: ignore[arg-type]
    assert agent.children.killed == [(2, 9)]


# --- a node that left before the job finished (issue 63's simulator found the wait) -------


@dataclass
class _Cfg:
    world_size: int = 4
    nproc: int = 2
    min_replicas: int | None = None
    store_wait_s: float = 60.0


class _Store:
    def __init__(self, finished: bool = False) -> None:
        self.finished = finished

    def check(self, keys: list[str]) -> bool:
        return self.finished


class _Keys:
    finished = "j/finished"


class _Leaving(_Agent):
    def __init__(self, cfg: _Cfg, finished: bool = False) -> None:
        super().__init__({})
        self.config, self.store, self.keys = cfg, _Store(finished), _Keys()
        self.failed: str | None = None
        self.stopping = self.draining = None

    def fail(self, why: str) -> None:
        self.failed = self.failed or why


def test_a_fixed_world_waits_for_a_node_that_left_then_fails_saying_why(capsys):
    import time

    agent = _Leaving(_Cfg())
    w = NodeWatch(agent)  # type: ignore[arg-type]
    w.node_done(1, True)
    assert "node 1 left the job before it finished" in capsys.readouterr().err
    assert [n for n, _ in agent.events.got] == ["node_left"]
    w.node_done(1, True)  # (told again: one wait)
    w.tick(time.monotonic())
    assert agent.failed is None
    w.tick(time.monotonic() + 61)
    assert agent.failed and "did not start again within 60 s" in agent.failed


def test_a_node_back_in_time_ends_the_wait():
    import time

    agent = _Leaving(_Cfg())
    w = NodeWatch(agent)  # type: ignore[arg-type]
    w.node_done(1, True)
    w.node_done(1, False)  # (a new agent cleared its mark)
    w.tick(time.monotonic() + 61)
    assert agent.failed is None and [n for n, _ in agent.events.got] == ["node_left", "node_back"]


@pytest.mark.parametrize(
    ("cfg", "finished"),
    [(_Cfg(min_replicas=2), False), (_Cfg(), True), (_Cfg(world_size=8, min_replicas=5), False)],
    ids=["elastic-goes-on", "the-jobs-end", "the-rest-reach-the-floor"],
)
def test_no_wait_where_the_job_goes_on_or_ended(cfg, finished):
    import time

    agent = _Leaving(cfg, finished)
    w = NodeWatch(agent)  # type: ignore[arg-type]
    w.node_done(1, True)
    w.tick(time.monotonic() + 61)
    assert agent.failed is None and agent.events.got == []


def test_whether_a_job_needs_a_node():
    from fastft.launch.rules.leftnodes import needs_node

    assert needs_node(4, 2, None) and needs_node(8, 2, 7)
    assert not needs_node(4, 2, 2) and not needs_node(8, 2, 6)
