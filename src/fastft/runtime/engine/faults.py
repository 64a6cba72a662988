"""The worker's faults: its own (reported on the bus and fed to the state machine),
its peers' (bus messages routed by :mod:`fastft.runtime.engine.inbox`), and planned ones (the
injector). Carried out for the executor, which alone takes its lock."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from fastft.inject import FaultKind, FaultSpec, StateLostFault, execute
from fastft.protocol import Heartbeat, Message, Severity
from fastft.protocol.faults import fault_of

if TYPE_CHECKING:
    from fastft.runtime.engine.ports import Engine

__all__ = ["Faults", "flip_bit"]

log = logging.getLogger(__name__)


ANSWER_EVERY_S = 0.25
"""A member answers joiners at most this often: one answer (a broadcast) serves every
joiner, each of which asks every 0.2 s (:data:`fastft.runtime.engine.joiners.ALIVE_S`
is 1 s)."""


class Faults:
    def __init__(self, x: Engine) -> None:
        self.x = x
        self._answered = float("-inf")

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
        x.report(severity, cause, gen)

    def on_message(self, m: Message) -> None:
        """The bus listener's callback."""
        x = self.x
        if isinstance(m, Heartbeat):  # a member's answer to this joiner: its epoch lives
            x.coord.answered(m.epoch)
            return
        r = fault_of(m)  # (the store read before the lock: a clean exit only)
        finished = r is not None and r.clean_exit and x.side.job_finished()
        ack = x.receive(m, finished)
        if isinstance(ack, Heartbeat):  # (a joiner's answer: one serves them all a while)
            now = time.monotonic()
            if now - self._answered < ANSWER_EVERY_S:
                return
            self._answered = now
        if ack is not None:
            x.sv.bus.broadcast(ack)

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
        if spec.kind is FaultKind.BITFLIP:  # silent: nothing raised, nothing told
            opt = x.registry.optimizer if spec.target == "optimizer" else None
            flip_bit(x.registry.model, int(spec.arg), opt)
        if spec.kind is FaultKind.STATE_LOST:
            # make the loss real: a worker that failed to heal ends with a wrong digest
            with torch.no_grad():
                for t in x.registry.model.parameters() if x.registry.model else ():
                    t.fill_(float("nan"))
            if x.registry.by_reference is not None:
                x.registry.by_reference.lose()
        execute(spec)


def flip_bit(
    model: torch.nn.Module | None, bit: int, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Flip ``bit`` of the first element of ``model``'s first float32 parameter (of the
    first float32 tensor of ``optimizer``'s state, if given), behind autograd's back
    (``.data``: no version counter sees it), as a faulty device would."""
    if optimizer is not None:
        found = [
            t
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() > 0
        ]
    else:
        found = [
            p for p in (model.parameters() if model is not None else ()) if p.dtype == torch.float32
        ]
    for t in found:
        if t.numel():
            with torch.no_grad():
                t.data.view(-1)[:1].view(torch.int32).bitwise_xor_(
                    1 << bit if bit < 31 else -(1 << 31)
                )
            return
    log.warning(
        "bitflip: no float32 %s registered: nothing flipped",
        "optimizer state" if optimizer else "parameter",
    )
