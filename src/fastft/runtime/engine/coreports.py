"""The engine core's two ports (:mod:`.core`).

:class:`Effects` performs the immediate actions, on the thread that fed the event;
:class:`MainThread` the main thread's, one at a time. The executor is both (on threads,
blocking: its main-thread actions return None once done), a simulated life is both (its
actions return the simulated seconds until it looks again), and
:class:`fastft.testing.engine.RecordingPort` is both for tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from fastft.fsm import (
        Action,
        ApplyCommit,
        CastVote,
        ConfigureProcessGroup,
        Event,
        ExitWorker,
        FetchState,
        FormEpoch,
        InvalidTransition,
        SendState,
        StepState,
        ZeroGrads,
    )
    from fastft.protocol import Message
    from fastft.runtime.contract import Member

__all__ = ["Effects", "MainThread"]

R = TypeVar("R", covariant=True)


class Effects(Protocol):
    """What the immediate actions do, on the thread that fed the event."""

    def transition(self, before: StepState, after: StepState, event: Event, moved: bool) -> None:
        """Seen before the transition's actions run (a log line, a trace)."""

    def invalid(self, e: InvalidTransition) -> None:
        """The state machine has no row for an event (logged and ignored)."""

    def failed(self, action: Action, e: Exception) -> None:
        """An immediate action raised; the transition's other actions still run."""

    def broadcast(self, m: Message) -> None: ...

    def interrupt(self, reason: str, epoch: int, step: int) -> None: ...

    def propose_rollback(self, epoch: int, step: int, reason: str) -> None: ...

    def abort_group(self, epoch: int, step: int) -> None: ...

    def cancel(self) -> None:
        """The step's pending futures fail (the interrupt already failed them)."""

    def declared_dead(self, who: Member, epoch: int) -> None: ...

    def record(self, name: str, fields: dict[str, Any]) -> None:
        """A record for the event log (a routed message's, a fault reported again)."""

    def woken(self) -> None:
        """A transition's actions ran: a main thread waiting for an event looks now."""

    def job_finished(self) -> bool:
        """Whether a member marked the job finished (a store read; asked only for a
        clean exit notice)."""


class MainThread(Protocol[R]):
    """What the main thread's actions do. The executor's return None once done; the
    simulator's return the simulated seconds until the life looks again."""

    def join(self) -> R: ...

    def vote(self, a: CastVote) -> R: ...

    def commit(self, a: ApplyCommit) -> R: ...

    def zero_grads(self, a: ZeroGrads) -> R: ...

    def form(self, a: FormEpoch) -> R: ...

    def configure(self, a: ConfigureProcessGroup) -> R: ...

    def heal(self, a: FetchState | SendState, *, fetch: bool) -> R: ...

    def exit(self, a: ExitWorker) -> R: ...
