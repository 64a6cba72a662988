"""A recording port for the engine's core (:mod:`fastft.runtime.engine.core`): both its
:class:`~fastft.runtime.engine.core.Effects` and its
:class:`~fastft.runtime.engine.core.MainThread`, each call kept in ``calls`` as
``(name, *arguments)``, so a test steps the real core one action at a time."""

from __future__ import annotations

from typing import Any

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
from fastft.runtime.engine.core import Effects, MainThread

__all__ = ["RecordingPort"]


class RecordingPort:
    """Records every effect and main-thread action; the main thread's return the action's
    name. ``finished``: what :meth:`job_finished` answers. Transitions are kept apart in
    ``transitions`` (``(event name, phase before, phase after)``), messages in ``sent``."""

    def __init__(self, *, finished: bool = False) -> None:
        self.finished = finished
        self.calls: list[tuple[Any, ...]] = []
        self.transitions: list[tuple[str, str, str]] = []
        self.sent: list[Message] = []

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def take(self) -> list[tuple[Any, ...]]:
        """The calls since the last take."""
        calls, self.calls = self.calls, []
        return calls

    # --- Effects ---------------------------------------------------------------------------
    def transition(self, before: StepState, after: StepState, event: Event, moved: bool) -> None:
        self.transitions.append((type(event).__name__, before.phase.name, after.phase.name))

    def woken(self) -> None:
        pass

    def invalid(self, e: InvalidTransition) -> None:
        self.calls.append(("invalid", str(e)))

    def failed(self, action: Action, e: Exception) -> None:
        self.calls.append(("failed", type(action).__name__, str(e)))

    def broadcast(self, m: Message) -> None:
        self.sent.append(m)
        self.calls.append(("broadcast", type(m).__name__))

    def interrupt(self, reason: str, epoch: int, step: int) -> None:
        self.calls.append(("interrupt", epoch, step))

    def propose_rollback(self, epoch: int, step: int, reason: str) -> None:
        self.calls.append(("propose_rollback", epoch, step))

    def abort_group(self, epoch: int, step: int) -> None:
        self.calls.append(("abort_group", epoch, step))

    def cancel(self) -> None:
        self.calls.append(("cancel",))

    def declared_dead(self, who: Member, epoch: int) -> None:
        self.calls.append(("declared_dead", who, epoch))

    def record(self, name: str, fields: dict[str, Any]) -> None:
        self.calls.append(("record", name))

    def job_finished(self) -> bool:
        return self.finished

    # --- MainThread ------------------------------------------------------------------------
    def join(self) -> str:
        self.calls.append(("join",))
        return "join"

    def vote(self, a: CastVote) -> str:
        self.calls.append(("vote", a.epoch, a.step))
        return "vote"

    def commit(self, a: ApplyCommit) -> str:
        self.calls.append(("commit", a.step))
        return "commit"

    def zero_grads(self, a: ZeroGrads) -> str:
        self.calls.append(("zero_grads",))
        return "zero_grads"

    def form(self, a: FormEpoch) -> str:
        self.calls.append(("form", a.exclude))
        return "form"

    def configure(self, a: ConfigureProcessGroup) -> str:
        self.calls.append(("configure", a.epoch))
        return "configure"

    def heal(self, a: FetchState | SendState, *, fetch: bool) -> str:
        self.calls.append(("heal", a.epoch, fetch))
        return "heal"

    def exit(self, a: ExitWorker) -> str:
        self.calls.append(("exit", a.reason))
        return "exit"


def _conforms(port: RecordingPort) -> tuple[Effects, MainThread[str]]:  # (mypy checks it)
    return port, port
