"""The agent's fence (issue 50): when its node was declared lost (a cut link, a stop), it
kills the worker lives the verdict named, never a newer life that started while the node
was cut off (it lost the store, exited, and was restarted: it joins as a new life)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
