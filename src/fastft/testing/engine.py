"""Fakes of the step engine's seams. :class:`RecordingPort`: both ports of the engine's core
(:mod:`fastft.runtime.engine.core`), :class:`~fastft.runtime.engine.coreports.Effects` and
:class:`~fastft.runtime.engine.coreports.MainThread`, each call kept in ``calls`` as
``(name, *arguments)``, so a test steps the real core one action at a time.
:class:`FakePlane`: the data plane without process groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.coreports import Effects, MainThread
from fastft.runtime.groups.dataplane import HealTail
from fastft.runtime.groups.hsdp import StepGate
from fastft.runtime.groups.plane import Plane

__all__ = ["FakePlane", "RecordingPort"]


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


class FakePlane:
    """A data plane without process groups (:class:`fastft.runtime.groups.plane.Plane`):
    building one always succeeds; its group is a token. For the engine over threads in one
    process (tests of the protocol, not of the collectives)."""

    def __init__(self, shard_size: int = 1) -> None:
        self.k = shard_size
        self.gate: StepGate | None = None
        self.pg: Any = None
        self.pg_epoch = -1
        self.heal_pg: tuple[int, Any] | None = None
        self.heal_tail: HealTail | None = None
        self.built: list[int] = []
        """The epochs whose group was built, in order."""

    def backend(self) -> str:
        return "gloo"

    def gpu(self) -> torch.device | None:
        return None

    def comm_device(self) -> torch.device:
        return torch.device("cpu")

    def heal_apart(self) -> bool:
        return True

    def group_ranks(self, view: EpochView, rank: int) -> list[int]:
        return sorted(view.ranks)

    def abort(self, epoch: int) -> None:
        self.release_heal(pending=True)
        self.pg = None

    def release_heal(self, *, pending: bool) -> None:
        self.heal_pg = self.heal_tail = None

    def configure(
        self, view: EpochView, rank: int, prefix: str, cancelled: Callable[[], bool]
    ) -> bool:
        self.pg, self.pg_epoch = object(), view.epoch
        self.built.append(view.epoch)
        return True

    def set_gate(self, gate: StepGate) -> None:
        self.gate = gate

    def hold_tail(self, tail: HealTail) -> bool:
        return False  # (no heal group here, so no tail in transit: heals are whole)

    def drop_tail(self, tail: HealTail) -> bool:
        return False


def _is_a_plane(plane: FakePlane) -> Plane:  # (mypy checks it)
    return plane
