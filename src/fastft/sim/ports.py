"""What a simulated life sees of its world, and of its peers (protocols: the world and
the life never import each other)."""

from __future__ import annotations

from typing import Any, Protocol

from fastft.protocol import JobKeys, Message
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.formation import Recovery
from fastft.sim.options import Options
from fastft.sim.store import SimStore

__all__ = ["Host", "Peer", "Verifier"]


class Peer(Protocol):
    alive: bool
    h: str
    held: int


class Verifier(Protocol):
    def vote(self, life: Any, epoch: int, step: int) -> None: ...
    def decision(self, life: Any, epoch: int, step: int, got: str) -> None: ...
    def apply(self, life: Any, step: int) -> None: ...
    def view(self, life: Any, view: EpochView) -> None: ...
    def restored(self, life: Any, step: int) -> None: ...
    def declared_dead(self, life: Any, who: Member) -> None: ...
    def heal_source(self, receiver: Any, source: Any) -> None: ...


class Host(Protocol):
    now: float
    opts: Options
    store: SimStore
    keys: JobKeys
    chain: list[str]
    lives: dict[Member, Any]
    collectives: dict[tuple[int, int], set[Member]]
    completed: dict[tuple[int, int], set[Member]]
    flagged: set[tuple[int, int]]
    snapshots: dict[tuple[int, int], dict[Member, str]]
    known_corrupt: set[str]
    pg_arrivals: dict[int, set[Member]]
    heal_arrivals: dict[int, set[Member]]
    built: dict[Member, int]
    checkpoints: dict[int, str]
    outcome: str | None
    slots: dict[int, Any]
    plan: Any
    draining: set[int]
    """Nodes whose agent drains its workers."""

    @property
    def checks(self) -> Verifier: ...

    def trace(self, who: Any, what: str) -> None: ...
    def violation(self, what: str) -> None: ...
    def wake(self, life: Any) -> None: ...
    def broadcast(self, sender: Any, m: Message) -> None: ...
    def compute_s(self) -> float: ...
    def finish(self, life: Any) -> None: ...
    def after_commit(self, life: Any, step: int) -> None: ...
    def fire_due(self, life: Any, point: str) -> None: ...
    def recovery(self) -> Recovery: ...
    def next_hash(self, h: str, step: int) -> str: ...
