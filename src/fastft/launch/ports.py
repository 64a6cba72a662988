"""What the agent's parts (:mod:`.exits`, :mod:`.nodewatch`, :mod:`.verdicts`) may use of
the node agent that owns them (STYLE 16): :class:`~fastft.launch.agent.Agent` satisfies
:class:`AgentPorts`. They change the job's course only through its methods (``fail``,
``drain``, ``restart_later``, ``wake``, ``publish``); the agent imports them and they
import nothing of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fastft.launch.children import Children, Slot
    from fastft.launch.config import LaunchConfig
    from fastft.launch.lease import NodeLease
    from fastft.launch.offenders import Offenders
    from fastft.launch.spares import SparePool
    from fastft.process.events import EventLog
    from fastft.protocol import JobKeys, Message

__all__ = ["AgentPorts"]


class AgentPorts(Protocol):
    """One node's agent as its parts see it."""

    config: LaunchConfig
    run_dir: Path
    events: EventLog
    keys: JobKeys
    store: Any
    slots: dict[int, Slot]
    children: Children
    spares: SparePool
    offenders: Offenders
    lease: NodeLease | None
    draining: float | None
    """When the agent drains its workers: the deadline after which it stops them."""
    failed: str | None
    """Why the job failed (None: it has not); set through :meth:`fail`."""
    stopping: int | None
    """The signal that stops the job (Ctrl-C, a second SIGTERM), if any."""
    restarts: int
    first_lives: dict[int, bool | None]
    fenced: set[int]
    taken_down: set[int]
    group_gen: dict[int, int]
    committed: Callable[[Slot], bool]

    @property
    def header(self) -> dict[str, Any]: ...

    @property
    def hosts_store(self) -> bool: ...

    def publish(self, msg: Message) -> None: ...

    def drain(self, why: str) -> None: ...

    def wake(self) -> None: ...

    def fail(self, why: str) -> None: ...

    def restart_later(self, slot: Slot, delay_s: float) -> None: ...

    def count_fault(self, rank: int, what: str) -> None:
        """A fault of ``rank``'s slot, for the repeat-offender count."""
