"""Contract of interrupt delivery: the exceptions a blocked rank sees."""

from __future__ import annotations

from fastft.errors import FastFTError
from fastft.protocol.faults import fault_of
from fastft.protocol.messages import Message

__all__ = ["StepInterrupted", "FutureCancelled", "CollectiveFailed"]


class StepInterrupted(BaseException):
    """The current step was interrupted by a fault (a peer's or a monitor's).

    A ``BaseException`` on purpose: a user's ``except Exception`` cannot swallow it. The
    runtime catches it at the step boundary and rolls the step back. ``message`` is the bus
    message that caused it (None for a local cause); ``epoch``/``step`` the step it ended.
    """

    def __init__(self, reason: str, *, epoch: int, step: int, message: Message | None = None):
        super().__init__(reason)
        self.reason = reason
        self.epoch = epoch
        self.step = step
        self.message = message

    @property
    def source_rank(self) -> int | None:
        """Rank the fault is about (faulty/exited/hung rank), else the sender's rank."""
        m = self.message
        if m is None:
            return None
        r = fault_of(m)
        return r.rank if r is not None else m.rank

    def __str__(self) -> str:
        return f"step {self.step} of epoch {self.epoch} interrupted: {self.reason}"


class FutureCancelled(FastFTError, RuntimeError):
    """Set on every pending future of an interrupted step (``Future.set_exception``)."""


class CollectiveFailed(FastFTError, RuntimeError):
    """A collective failed by itself (a peer's connection reset) before any interrupt
    arrived: treat it as a transient fault of the step (Fault2) and roll back."""
