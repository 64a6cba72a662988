"""What the runtime's parts may use of it (STYLE 16): :class:`fastft.runtime.api.Runtime`
satisfies :class:`RuntimePorts`; the step's entry and exit (:mod:`.attempt`), the
transaction, the sync policies, the pipeline's hold, the health checks and the in-process
restart are written against this protocol, not against the class that owns them (no
import cycle, and a test can hand them a fake)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fastft.fsm import StepState
    from fastft.inject.execute import Injector
    from fastft.interrupt import Interrupter
    from fastft.process.events import EventLog
    from fastft.process.heartbeat import HeartbeatWriter
    from fastft.runtime.contract import EpochView, HealthCheck, RuntimeConfig
    from fastft.runtime.engine.core import Seen
    from fastft.runtime.groups.flow import Flow
    from fastft.runtime.groups.plane import Plane
    from fastft.runtime.state.kept import KeptGradients
    from fastft.runtime.state.registry import StateRegistry

__all__ = ["RuntimePorts", "StepEngine", "VotePorts"]


class StepEngine(Protocol):
    """The step engine as the step's entry and exit, the transaction, the sync policies
    and the in-process restart see it (:class:`~fastft.runtime.engine.executor.Executor`
    is one). It never hands out its lock: :meth:`seen` reads under it."""

    @property
    def state(self) -> StepState: ...

    @property
    def view(self) -> EpochView | None: ...

    @property
    def phase_changes(self) -> int: ...

    @property
    def dp(self) -> Plane: ...

    @property
    def kept(self) -> KeptGradients: ...

    @property
    def closing(self) -> bool: ...

    def seen(self) -> Seen:
        """The state, the view and the phase changes at one moment (read under the
        engine's lock, which a part never takes)."""

    def grads_ready(self, step: int, agreed: bool, confirm: bool = False) -> None:
        """The step's gradients are ready: fed unless a fault moved the machine on."""

    def local_fault(self, exc: BaseException, gen: int | None = None) -> None:
        """This worker's own fault: on the bus and into the machine, unless the machine
        moved since ``gen`` (a consequence of a fault already handled)."""

    def suspect(self, doubt: bool) -> None: ...

    def finish_heal_tail(self) -> None:
        """Before the vote: the optimizer state a heal sent while the step ran."""


class VotePorts(Protocol):
    """The step's vote as the gradients' allreduce carries it (:mod:`.state.inband`;
    :class:`~fastft.runtime.agreement.Agreement` is one)."""

    def slots(self) -> int:
        """Slots the gradient bucket holds for the vote."""

    def carry(self, slots: torch.Tensor | None) -> bool:
        """Before the allreduce: this member's vote into ``slots`` (False: none)."""

    def carried(self, slots: torch.Tensor) -> None:
        """After the allreduce completed: what every member's vote said."""


class RuntimePorts(Protocol):
    """One worker's runtime as its parts see it."""

    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def rank(self) -> int: ...

    @property
    def registry(self) -> StateRegistry: ...

    @property
    def interrupter(self) -> Interrupter: ...

    @property
    def events(self) -> EventLog: ...

    @property
    def injector(self) -> Injector: ...

    @property
    def flow(self) -> Flow | None: ...

    @property
    def engine(self) -> StepEngine:
        """The step engine: the state machine's state, the epoch's view, the data plane."""

    @property
    def heartbeat(self) -> HeartbeatWriter: ...

    @property
    def registered(self) -> bool: ...

    @property
    def health_checks(self) -> list[tuple[str, HealthCheck]]: ...

    @property
    def step(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def sharded(self) -> bool: ...

    @property
    def vote(self) -> VotePorts:
        """The step's vote, as the gradients' allreduce carries it (:mod:`.state.inband`)."""

    def drive(
        self,
        done: Callable[[StepState], bool],
        *,
        settled: Callable[[StepState], bool] | None = None,
    ) -> None:
        """Run the engine's queued actions until ``done(state)``; ``settled``: return
        when it holds, before the next queued action (main thread)."""

    def require_pg(self) -> Any:
        """The epoch's process group (raises if a fault came first)."""

    def reduce_gradients(self, model: nn.Module | None) -> None:
        """``tx.allreduce_gradients()``."""

    def close(self, *, finished: bool = True) -> None: ...
