"""What the engine's parts (:mod:`.membership`, :mod:`.faults`) may use of the executor
that owns them (STYLE 16): :class:`~fastft.runtime.engine.executor.Executor` satisfies
:class:`Engine`. The parts are written against this protocol, so the executor imports
them and they import nothing of it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fastft.fsm import Event, Phase, StepState
    from fastft.process.events import EventLog
    from fastft.process.services import Services
    from fastft.runtime.contract import EpochView, Member, RuntimeConfig
    from fastft.runtime.durable.checkpoints import Checkpoints
    from fastft.runtime.durable.commit import CommitCheckpoints
    from fastft.runtime.engine.coordinator import Coordinator
    from fastft.runtime.engine.sideclient import SideClient
    from fastft.runtime.groups.dataplane import DataPlane
    from fastft.runtime.state.kept import KeptGradients
    from fastft.runtime.state.registry import StateRegistry

__all__ = ["Engine"]


class Engine(Protocol):
    """One worker's step engine as its parts see it. ``lock`` guards ``state``, ``view``
    and ``dead``; ``feed_locked`` is called under it."""

    config: RuntimeConfig
    me: Member
    view: EpochView | None
    state: StepState
    lock: threading.RLock
    events: EventLog
    registry: StateRegistry
    coord: Coordinator
    side: SideClient
    dp: DataPlane
    kept: KeptGradients
    durable: Checkpoints | None
    checkpoints: CommitCheckpoints
    dead: set[Member]
    suspect_state: bool
    phase_changes: int
    closing: bool

    @property
    def sv(self) -> Services: ...

    def feed(self, event: Event) -> None: ...

    def feed_locked(self, event: Event) -> None: ...

    def header(self) -> dict[str, Any]: ...

    def replay_early(self) -> None:
        """Route again the bus messages kept for an epoch not adopted yet."""

    def declare_silent(self, ranks: frozenset[int]) -> None:
        """Declare dead members that never arrived at a formation (the agent kills them)."""

    def remind(self) -> None:
        """Ask the members a formation still misses to roll back (one broadcast)."""

    def cancelled(self, phase: Phase) -> Callable[[], bool]: ...
