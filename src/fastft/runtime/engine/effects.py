"""The core's immediate actions (:class:`~fastft.runtime.engine.coreports.Effects`) as a
worker performs them, on the thread that fed the event (the bus listener's or the main
thread's, under the executor's lock): log a transition, wake the main thread, interrupt
the step, propose the rollback, abort the epoch's group, broadcast, record."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from fastft.fsm import Action, Event, InvalidTransition, Phase, StepState
from fastft.interrupt import Interrupter
from fastft.process.events import EventLog
from fastft.process.services import Services
from fastft.protocol import Message
from fastft.runtime.contract import Member
from fastft.runtime.engine.inbox import REPEATED, repeats_logged
from fastft.runtime.engine.sideclient import SideClient
from fastft.runtime.groups.plane import Plane

__all__ = ["Immediate"]

log = logging.getLogger(__name__)

_STEP_CYCLE = (Phase.NORMAL, Phase.PREPARED, Phase.COMMIT)


class Immediate:
    """One worker's :class:`~fastft.runtime.engine.coreports.Effects` (``sv``: the
    worker's services, once attached)."""

    def __init__(
        self,
        cond: threading.Condition,
        interrupter: Interrupter,
        side: SideClient,
        dp: Plane,
        events: EventLog,
        sv: Callable[[], Services],
    ) -> None:
        self.cond = cond
        self.interrupter = interrupter
        self.side = side
        self.dp = dp
        self.events = events
        self.sv = sv
        self._repeats: dict[tuple[object, ...], int] = {}
        """Occurrences of each repeated record (:data:`.inbox.REPEATED`)."""

    def transition(self, before: StepState, after: StepState, event: Event, moved: bool) -> None:
        if moved and not (before.phase in _STEP_CYCLE and after.phase in _STEP_CYCLE):
            # the fault-free cycle NORMAL -> PREPARED -> COMMIT is logged as commits
            self.events.emit(
                "phase",
                frm=before.phase.name,
                to=after.phase.name,
                epoch=after.epoch,
                step=after.step,
                on=type(event).__name__,
                reason=after.reason or None,
            )

    def woken(self) -> None:
        self.cond.notify_all()  # (the main thread wakes once the lock is released)

    def invalid(self, e: InvalidTransition) -> None:
        log.error("state machine: %s (ignored)", e)

    def failed(self, action: Action, e: Exception) -> None:
        log.error("action %s failed: %s: %s", type(action).__name__, type(e).__name__, e)
        self.events.emit("action_failed", action=type(action).__name__, error=str(e)[:300])

    def broadcast(self, m: Message) -> None:
        self.sv().bus.broadcast(m)

    def interrupt(self, reason: str, epoch: int, step: int) -> None:
        if self.interrupter.interrupt(reason, epoch=epoch):
            self.events.emit("interrupt", epoch=epoch, step=step, reason=reason)

    def propose_rollback(self, epoch: int, step: int, reason: str) -> None:
        got = self.side.propose_rollback(epoch, step, reason)
        self.events.emit(
            "propose_rollback", epoch=epoch, step=step, reason=reason, decision=got[:1]
        )

    def abort_group(self, epoch: int, step: int) -> None:
        self.sv().injector.fire_due(step, point="rollback")  # tests: death mid-rollback
        self.dp.abort(epoch)

    def cancel(self) -> None:
        pass  # the interrupt already failed every pending future of the step

    def declared_dead(self, who: Member, epoch: int) -> None:
        self.events.emit("declare_dead", rank=who.rank, incarnation=who.incarnation, epoch=epoch)

    def record(self, name: str, fields: dict[str, Any]) -> None:
        if name in REPEATED:  # (a flood of the same record: 1st, 10th, 100th...)
            key = (name, *sorted(fields.items()))
            n = self._repeats[key] = self._repeats.get(key, 0) + 1
            if repeats_logged(n):
                self.events.emit(name, **fields, count=n)
        else:
            self.events.emit(name, **fields)

    def job_finished(self) -> bool:
        return self.side.job_finished()
