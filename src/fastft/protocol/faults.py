"""What a fault message says about whom: the one place that unpacks the faulty, exited and
hung fields of :class:`Fault`, :class:`ProcessExited` and :class:`HangSuspected`. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from fastft.protocol.messages import (
    EXIT_DRAINED,
    Fault,
    HangSuspected,
    Message,
    ProcessExited,
    Severity,
)

__all__ = ["FaultReport", "fault_of"]


@dataclass(frozen=True)
class FaultReport:
    """``rank``/``incarnation``: the life the message is about (incarnation 0: any);
    ``severity``: FAULT1 (its state is gone) or FAULT2 (transient); ``cause``: one line;
    ``dead``: the life is gone (exited, hung, stopped, declared dead by a peer or a
    monitor); a life reporting its own Fault1 lost its state but lives;
    ``clean_exit``: it exited with code 0; ``drained``: it exited after a drain
    (:data:`EXIT_DRAINED`: every member had let it go); ``self_reported``: sent by that
    life itself."""

    rank: int
    incarnation: int
    severity: Severity
    cause: str
    dead: bool
    clean_exit: bool = False
    drained: bool = False
    self_reported: bool = False

    @property
    def who(self) -> tuple[int, int]:
        return (self.rank, self.incarnation)


def fault_of(m: Message) -> FaultReport | None:
    """The fault ``m`` reports, or None if it reports none."""
    if isinstance(m, Fault):
        own = m.sender == (m.faulty_rank, m.faulty_incarnation)
        return FaultReport(
            m.faulty_rank,
            m.faulty_incarnation,
            m.severity,
            m.cause,
            dead=m.severity is Severity.FAULT1 and bool(m.faulty_incarnation) and not own,
            self_reported=own,
        )
    if isinstance(m, ProcessExited):
        how = f"signal {m.signal}" if m.signal is not None else f"code {m.exit_code}"
        return FaultReport(
            m.exited_rank,
            m.exited_incarnation,
            Severity.FAULT1,
            f"rank {m.exited_rank} exited ({how})",
            dead=bool(m.exited_incarnation),
            clean_exit=m.exit_code == 0,
            drained=m.exit_code == EXIT_DRAINED and m.ending,
        )
    if isinstance(m, HangSuspected):
        what = "stopped" if m.stopped else "hung"
        return FaultReport(
            m.hung_rank,
            m.hung_incarnation,
            Severity.FAULT1,
            f"rank {m.hung_rank} {what}",
            dead=bool(m.hung_incarnation),
        )
    return None
