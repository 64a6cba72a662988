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
    from fastft.launch.procs.children import Children, Slot
    from fastft.launch.procs.spares import SparePool
    from fastft.launch.rules.ledger import Ledger
    from fastft.launch.rules.offenders import Offenders
    from fastft.launch.settings.config import LaunchConfig
    from fastft.process.events import EventLog
    from fastft.protocol import JobKeys, Message

__all__ = ["AgentPorts", "StoreWatch"]


class StoreWatch(Protocol):
    """What the parts read of the agent's watch on the store."""

    store_gone: bool
    """The store stopped answering this agent: a call to it would not return."""

    def record_lives(self) -> None:
        """Write this node's worker lives to the store: before a life starts."""


class AgentPorts(Protocol):
    """One node's agent as its parts see it."""

    @property
    def config(self) -> LaunchConfig: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def events(self) -> EventLog: ...

    @property
    def keys(self) -> JobKeys: ...

    @property
    def store(self) -> Any: ...

    @property
    def slots(self) -> dict[int, Slot]: ...

    @property
    def nodes(self) -> StoreWatch:
        """The node's lease and the other nodes (:class:`~fastft.launch.nodes.nodewatch.NodeWatch`)."""

    @property
    def children(self) -> Children: ...

    @property
    def spares(self) -> SparePool: ...

    @property
    def offenders(self) -> Offenders: ...

    @property
    def draining(self) -> float | None:
        """When the agent drains its workers: the deadline after which it stops them."""

    @property
    def failed(self) -> str | None:
        """Why the job failed (None: it has not); set through :meth:`fail`."""

    @property
    def stopping(self) -> int | None:
        """The signal that stops the job (Ctrl-C, a second SIGTERM), if any."""

    @property
    def ledger(self) -> Ledger:
        """What the agent did to its node's lives: changed through its methods only."""

    @property
    def committed(self) -> Callable[[Slot], bool]: ...

    @property
    def header(self) -> dict[str, Any]: ...

    @property
    def hosts_store(self) -> bool: ...

    @property
    def lighthouse_addr(self) -> str:
        """torchft's lighthouse (``--torchft``), "" without one."""

    def publish(self, msg: Message) -> None: ...

    def drain(self, why: str) -> None: ...

    def wake(self) -> None: ...

    def fail(self, why: str) -> None: ...

    def restart_later(self, slot: Slot, delay_s: float) -> None: ...

    def count_fault(self, rank: int, what: str) -> None:
        """A fault of ``rank``'s slot, for the repeat-offender count."""
