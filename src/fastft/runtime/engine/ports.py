"""What the engine's parts (:mod:`.membership`, :mod:`.faults`) may use of the executor
that owns them (STYLE 16): :class:`~fastft.runtime.engine.executor.Executor` satisfies
:class:`Engine`. The parts are written against this protocol, so the executor imports
them and they import nothing of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fastft.fsm import Event, Phase, StepState
    from fastft.process.events import EventLog
    from fastft.process.services import Services
    from fastft.protocol import Message, Severity
    from fastft.runtime.contract import EpochView, Member, RuntimeConfig
    from fastft.runtime.durable.checkpoints import Checkpoints
    from fastft.runtime.durable.commit import CommitCheckpoints
    from fastft.runtime.engine.coordinator import Coordinator
    from fastft.runtime.engine.sideclient import SideClient
    from fastft.runtime.groups.plane import Plane
    from fastft.runtime.state.kept import KeptGradients
    from fastft.runtime.state.registry import StateRegistry

__all__ = ["Engine"]


class Engine(Protocol):
    """One worker's step engine as its parts see it. Its lock is the executor's alone:
    ``feed``, ``adopt``, ``report`` and ``receive`` take it; ``state``, ``view`` and ``dead``
    are read as they stand (a part that needs them together asks for a plan with them)."""

    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def me(self) -> Member: ...

    @property
    def events(self) -> EventLog: ...

    @property
    def registry(self) -> StateRegistry: ...

    @property
    def coord(self) -> Coordinator: ...

    @property
    def side(self) -> SideClient: ...

    @property
    def dp(self) -> Plane: ...

    @property
    def kept(self) -> KeptGradients: ...

    @property
    def durable(self) -> Checkpoints | None: ...

    @property
    def checkpoints(self) -> CommitCheckpoints: ...

    @property
    def closing(self) -> bool: ...

    @property
    def state(self) -> StepState: ...

    @property
    def view(self) -> EpochView | None: ...

    @property
    def dead(self) -> set[Member]: ...

    @property
    def sv(self) -> Services: ...

    @property
    def suspect_state(self) -> bool:
        """An in-process restart left this worker's state in doubt."""

    def suspect(self, doubt: bool) -> None:
        """Put this worker's state in doubt (True), or settle it (False)."""

    def feed(self, event: Event) -> None: ...

    def adopt(self, view: EpochView, source: int | None) -> None:
        """Enter ``view``: the core's :meth:`~.core.Core.adopt`."""

    def report(self, severity: Severity, cause: str, gen: int | None = None) -> None:
        """This worker's own fault, on the bus and into the machine, unless the machine
        moved since the failed work began (``gen``)."""

    def receive(self, m: Message, finished: bool | None = None) -> Message | None:
        """A bus message into the core; a drain ack to send back."""

    def declare_silent(self, ranks: frozenset[int]) -> None:
        """Declare dead members that never arrived at a formation (the agent kills them)."""

    def remind(self) -> None:
        """Ask the members a formation still misses to roll back (one broadcast)."""

    def cancelled(self, phase: Phase) -> Callable[[], bool]: ...
