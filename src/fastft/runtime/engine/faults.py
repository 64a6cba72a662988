"""The worker's faults: its own (reported on the bus and fed to the state machine),
its peers' (bus messages routed by :mod:`fastft.runtime.engine.inbox`), and planned ones (the
injector). Performed for the executor, under its lock."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from fastft.fsm import LocalFault
from fastft.inject import FaultKind, FaultSpec, StateLostFault, execute
from fastft.protocol import DrainAck, Fault, Message, Severity
from fastft.protocol.faults import fault_of
from fastft.runtime.engine.inbox import EARLY_KEPT, REPEATED, repeats_logged, route
from fastft.runtime.engine.todo import superseded

if TYPE_CHECKING:
    from fastft.runtime.engine.ports import Engine

__all__ = ["Faults"]


class Faults:
    def __init__(self, x: Engine) -> None:
        self.x = x
        self.repeats: dict[tuple[object, ...], int] = {}
        """Occurrences of each repeated record (:data:`.inbox.REPEATED`)."""
        self.early: collections.deque[Message] = collections.deque(maxlen=EARLY_KEPT)
        """Rollback messages of an epoch not adopted yet (:attr:`.inbox.Routed.early`)."""

    def local(self, exc: BaseException, gen: int | None = None) -> None:
        """Report this worker's own fault: event, bus, state machine. ``gen``: the count of
        phase changes when the failed work began; if the state machine moved since (a
        peer's fault already rolled the step back, and perhaps finished the rollback), the
        failure is a consequence of that fault and starts nothing: a second rollback
        cycle there would wait for members that are already past it."""
        x = self.x
        severity = Severity.FAULT1 if isinstance(exc, StateLostFault) else Severity.FAULT2
        cause = f"{type(exc).__name__}: {exc}"
        x.kept.fault()
        with x.lock:
            s = x.state
            if superseded(gen, x.phase_changes, severity):
                x.events.emit("local_fault_superseded", step=s.step, cause=cause[:300])
                return
            x.events.emit(
                "local_fault",
                step=s.step,
                epoch=s.epoch,
                severity=severity.name,
                cause=cause[:500],
                incarnation=x.me.incarnation,
            )
            x.sv.bus.broadcast(
                Fault(
                    **x.header(),
                    severity=severity,
                    cause=cause[:2000],
                    faulty_rank=x.me.rank,
                    faulty_incarnation=x.me.incarnation,
                )
            )
            x.feed_locked(LocalFault(severity, cause[:200]))

    def on_message(self, m: Message) -> None:
        """The bus listener's callback."""
        x = self.x
        r = fault_of(m)
        finished = r is not None and r.clean_exit and x.side.job_finished()
        with x.lock:
            s = x.state
            out = route(
                m,
                me=x.me,
                view=x.view,
                epoch=s.epoch,
                step=s.step,
                dead=x.dead,
                finished=finished,
                world_size=x.config.world_size,
                leaving=s.leaving,
            )
            if out.early:
                self.early.append(m)
                return
            if out.dead is not None:
                x.dead.add(out.dead)
            if out.record is not None:
                name, fields = out.record
                if name in REPEATED:  # (a flood of the same record: 1st, 10th, 100th...)
                    key = (name, *sorted(fields.items()))
                    n = self.repeats[key] = self.repeats.get(key, 0) + 1
                    if repeats_logged(n):
                        x.events.emit(name, **fields, count=n)
                else:
                    x.events.emit(name, **fields)
            for ev in out.events:
                x.feed_locked(ev)
            header = x.header()
        if out.ack_drain is not None:
            x.sv.bus.broadcast(DrainAck(**header, drained_rank=out.ack_drain))

    def replay_early(self) -> None:
        """After adopting a view: route the early messages again (those of a later epoch
        still wait)."""
        with self.x.lock:
            kept, self.early = list(self.early), collections.deque(maxlen=EARLY_KEPT)
            for m in kept:
                self.on_message(m)

    def inject(self, spec: FaultSpec) -> None:
        x = self.x
        s = x.state
        x.events.emit(
            "injected",
            kind=spec.kind.value,
            point=spec.point,
            step=s.step,
            epoch=s.epoch,
            incarnation=x.me.incarnation,
        )
        if spec.kind is FaultKind.STATE_LOST:
            # make the loss real: a worker that failed to heal ends with a wrong digest
            with torch.no_grad():
                for t in x.registry.model.parameters() if x.registry.model else ():
                    t.fill_(float("nan"))
            if x.registry.by_reference is not None:
                x.registry.by_reference.lose()
        execute(spec)
