"""The fastft wire protocol: message types, their encoding and the store's key names.

Pure: no I/O, no clock reads, no threads.
"""

from fastft.errors import ProtocolError
from fastft.protocol.codec import decode, encode
from fastft.protocol.keys import JobKeys
from fastft.protocol.messages import (
    EXIT_DRAINED,
    MESSAGE_TYPES,
    NO_RANK,
    NO_STEP,
    WIRE_VERSION,
    DrainAck,
    DrainNotice,
    DrainRequest,
    Fault,
    HangSuspected,
    Heartbeat,
    Inject,
    JoinRequest,
    Message,
    ProcessExited,
    Role,
    RollbackRequest,
    Severity,
)

__all__ = [
    "MESSAGE_TYPES",
    "NO_RANK",
    "NO_STEP",
    "EXIT_DRAINED",
    "DrainRequest",
    "WIRE_VERSION",
    "DrainAck",
    "DrainNotice",
    "Fault",
    "HangSuspected",
    "Heartbeat",
    "JoinRequest",
    "Inject",
    "JobKeys",
    "Message",
    "ProcessExited",
    "ProtocolError",
    "Role",
    "RollbackRequest",
    "Severity",
    "decode",
    "encode",
]
