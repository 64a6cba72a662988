"""Message types of the fastft wire protocol (version 1).

Every message carries the same header: ``job`` (the job id; messages of other jobs are
foreign), ``epoch`` (membership generation, see DESIGN "epoch"), the sender's ``rank`` and
``incarnation`` (one life of one worker; ``rank == -1`` for senders that are not training
workers: node agents, monitors, operators, see ``role``), the sender's ``step``, a per-sender
monotonic ``seq`` and ``wall_time`` (seconds since the Unix epoch). ``seq`` and
``wall_time`` are stamped by the bus endpoint at broadcast time; construct messages with
the defaults.

Messages are frozen dataclasses; each kind has a stable one-byte ``KIND`` code that is part
of the wire format and must never be reused for a different meaning.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar

from fastft.errors import ProtocolError
from fastft.protocol.exits import EXIT_DRAINED

__all__ = [
    "WIRE_VERSION",
    "Role",
    "Severity",
    "Message",
    "Fault",
    "ProcessExited",
    "HangSuspected",
    "RollbackRequest",
    "DrainNotice",
    "DrainAck",
    "Inject",
    "Heartbeat",
    "JoinRequest",
    "MESSAGE_TYPES",
    "NO_RANK",
    "NO_STEP",
    "EXIT_DRAINED",
    "DrainRequest",
]

WIRE_VERSION = 1
NO_RANK = -1
"""``rank`` of a sender that is not a training worker (agent, monitor, operator)."""
NO_STEP = -1
"""``step`` when the sender does not know or have one."""

_U32 = 2**32 - 1
_I32 = 2**31 - 1
_U64 = 2**64 - 1
_I64 = 2**63 - 1
MAX_TEXT = 64 * 1024
"""Longest string field (bytes of UTF-8) a message may carry; tracebacks are truncated."""


class Role(enum.IntEnum):
    """Who sent a message."""

    WORKER = 1
    AGENT = 2
    MONITOR = 3
    OPERATOR = 4


class Severity(enum.IntEnum):
    """How bad a fault is (DESIGN "Fault1"/"Fault2")."""

    FAULT1 = 1
    """State lost (process died, GPU state corrupt): the worker must heal from a peer."""
    FAULT2 = 2
    """Transient, local state intact: roll back the step, no state transfer."""


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(f"field {name}={value!r} must be an int in [{lo}, {hi}]")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise ProtocolError(f"field {name}={value!r} must be a str")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_TEXT:
        raise ProtocolError(f"field {name} is longer than {MAX_TEXT} bytes")


@dataclass(frozen=True, kw_only=True)
class Message:
    """Header shared by every message. Do not instantiate directly; use a subclass."""

    KIND: ClassVar[int] = 0

    job: str
    epoch: int
    rank: int
    incarnation: int
    step: int = NO_STEP
    role: Role = Role.WORKER
    seq: int = 0
    wall_time: float = 0.0

    def __post_init__(self) -> None:
        if type(self) is Message:
            raise ProtocolError("Message is abstract; use one of MESSAGE_TYPES")
        _check_text("job", self.job)
        if not self.job or len(self.job) > 255:
            raise ProtocolError(f"job id {self.job!r} must be 1-255 characters")
        _check_int("epoch", self.epoch, 0, _U32)
        _check_int("rank", self.rank, NO_RANK, _I32)
        _check_int("incarnation", self.incarnation, 0, _U64)
        _check_int("step", self.step, NO_STEP, _I64)
        _check_int("seq", self.seq, 0, _U64)
        if not isinstance(self.role, Role):
            try:
                object.__setattr__(self, "role", Role(self.role))
            except ValueError as e:
                raise ProtocolError(f"unknown role {self.role!r}") from e
        if isinstance(self.wall_time, int) and not isinstance(self.wall_time, bool):
            object.__setattr__(self, "wall_time", float(self.wall_time))
        if not isinstance(self.wall_time, float) or not math.isfinite(self.wall_time):
            raise ProtocolError(f"wall_time={self.wall_time!r} must be a finite float")
        self._validate_body()

    def _validate_body(self) -> None:
        """Subclasses check their own fields; raise ProtocolError."""

    @property
    def sender(self) -> tuple[int, int]:
        """``(rank, incarnation)``: one life of one sender."""
        return (self.rank, self.incarnation)


@dataclass(frozen=True, kw_only=True)
class Fault(Message):
    """A fault of ``faulty_rank`` (its own report, or a monitor's about it)."""

    KIND: ClassVar[int] = 1

    severity: Severity
    cause: str
    faulty_rank: int
    faulty_incarnation: int = 0
    detail: str = ""

    def _validate_body(self) -> None:
        if isinstance(self.severity, bool):
            raise ProtocolError("severity must be a Severity, not a bool")
        if not isinstance(self.severity, Severity):
            try:
                object.__setattr__(self, "severity", Severity(self.severity))
            except ValueError as e:
                raise ProtocolError(f"unknown severity {self.severity!r}") from e
        _check_text("cause", self.cause)
        _check_text("detail", self.detail)
        _check_int("faulty_rank", self.faulty_rank, 0, _I32)
        _check_int("faulty_incarnation", self.faulty_incarnation, 0, _U64)


@dataclass(frozen=True, kw_only=True)
class ProcessExited(Message):
    """A node agent saw a worker process end. Exactly one of ``exit_code`` and ``signal``
    is set (``signal`` when the process was killed by a signal). ``ending``: the status is
    fastft's own (the worker recorded it: :data:`~fastft.protocol.exits.FASTFT_STATUSES`),
    not one the script chose."""

    KIND: ClassVar[int] = 2

    exited_rank: int
    exited_incarnation: int
    exit_code: int | None = None
    signal: int | None = None
    ending: bool = False

    def _validate_body(self) -> None:
        _check_int("exited_rank", self.exited_rank, 0, _I32)
        _check_int("exited_incarnation", self.exited_incarnation, 0, _U64)
        if (self.exit_code is None) == (self.signal is None):
            raise ProtocolError("exactly one of exit_code and signal must be set")
        if self.exit_code is not None:
            _check_int("exit_code", self.exit_code, -_I32, _I32)
        if self.signal is not None:
            _check_int("signal", self.signal, 1, 255)
        if not isinstance(self.ending, bool):
            raise ProtocolError("ending must be a bool")

    @property
    def severity(self) -> Severity:
        return Severity.FAULT1


@dataclass(frozen=True, kw_only=True)
class HangSuspected(Message):
    """A watchdog saw no progress from ``hung_rank`` for ``silent_for_s`` seconds, or saw the
    process stop (SIGSTOP: ``stopped=True``)."""

    KIND: ClassVar[int] = 3

    hung_rank: int
    hung_incarnation: int
    silent_for_s: float
    stopped: bool = False

    def _validate_body(self) -> None:
        _check_int("hung_rank", self.hung_rank, 0, _I32)
        _check_int("hung_incarnation", self.hung_incarnation, 0, _U64)
        if isinstance(self.silent_for_s, int) and not isinstance(self.silent_for_s, bool):
            object.__setattr__(self, "silent_for_s", float(self.silent_for_s))
        if (
            not isinstance(self.silent_for_s, float)
            or not math.isfinite(self.silent_for_s)
            or self.silent_for_s < 0
        ):
            raise ProtocolError(f"silent_for_s={self.silent_for_s!r} must be a float >= 0")
        if not isinstance(self.stopped, bool):
            raise ProtocolError(f"stopped={self.stopped!r} must be a bool")


@dataclass(frozen=True, kw_only=True)
class RollbackRequest(Message):
    """The sender asks every member of ``epoch`` to roll back ``step``: a formation of the
    next epoch reminds the members it misses. (Kind 5, the rollback barrier's
    acknowledgement, is gone with that barrier: issue 35.)"""

    KIND: ClassVar[int] = 4

    reason: str = ""

    def _validate_body(self) -> None:
        _check_text("reason", self.reason)


@dataclass(frozen=True, kw_only=True)
class DrainNotice(Message):
    """The sender committed ``step`` and is leaving on purpose (no rollback needed)."""

    KIND: ClassVar[int] = 6

    reason: str = ""

    def _validate_body(self) -> None:
        _check_text("reason", self.reason)


@dataclass(frozen=True, kw_only=True)
class DrainAck(Message):
    """The sender has seen a drain notice and will not wait for the drained worker."""

    KIND: ClassVar[int] = 7

    drained_rank: int

    def _validate_body(self) -> None:
        _check_int("drained_rank", self.drained_rank, 0, _I32)


@dataclass(frozen=True, kw_only=True)
class Inject(Message):
    """Ask ``target_rank`` to inject a fault of the catalogue (``fastft.inject``).

    ``at_step == NO_STEP`` means at once; ``arg`` is the kind's parameter (exit code, hang
    seconds; 0 for none)."""

    KIND: ClassVar[int] = 8

    target_rank: int
    fault_kind: str
    at_step: int = NO_STEP
    arg: float = 0.0

    def _validate_body(self) -> None:
        _check_int("target_rank", self.target_rank, 0, _I32)
        _check_text("fault_kind", self.fault_kind)
        if not self.fault_kind:
            raise ProtocolError("fault_kind must not be empty")
        _check_int("at_step", self.at_step, NO_STEP, _I64)
        if isinstance(self.arg, int) and not isinstance(self.arg, bool):
            object.__setattr__(self, "arg", float(self.arg))
        if not isinstance(self.arg, float) or not math.isfinite(self.arg):
            raise ProtocolError(f"arg={self.arg!r} must be a finite float")


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """Liveness and progress of the sender (its ``step``)."""

    KIND: ClassVar[int] = 9


@dataclass(frozen=True, kw_only=True)
class JoinRequest(Message):
    """The sender (``rank``, ``incarnation``: a started or restarted worker) waits to be
    admitted to the next epoch; members re-form the epoch after their next commit."""

    KIND: ClassVar[int] = 10


@dataclass(frozen=True, kw_only=True)
class DrainRequest(Message):
    """Ask a worker (``target_rank``) or every worker of a node's agent (``target_node``)
    to drain: leave the job after the next commit, with nothing rolled back
    (``fastft drain``)."""

    KIND: ClassVar[int] = 11

    target_rank: int = NO_RANK
    target_node: int = NO_RANK
    reason: str = ""

    def _validate_body(self) -> None:
        _check_int("target_rank", self.target_rank, NO_RANK, _I32)
        _check_int("target_node", self.target_node, NO_RANK, _I32)
        if (self.target_rank == NO_RANK) == (self.target_node == NO_RANK):
            raise ProtocolError("a drain request names a rank or a node, one of them")
        _check_text("reason", self.reason)


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Fault,
        ProcessExited,
        HangSuspected,
        RollbackRequest,
        DrainNotice,
        DrainAck,
        Inject,
        Heartbeat,
        JoinRequest,
        DrainRequest,
    )
}

_HEADER_FIELDS = frozenset(f for f in Message.__dataclass_fields__)


def body_fields(cls: type[Message]) -> tuple[str, ...]:
    """Names of the fields a message kind adds to the header, in declaration order."""
    return tuple(f for f in cls.__dataclass_fields__ if f not in _HEADER_FIELDS)
