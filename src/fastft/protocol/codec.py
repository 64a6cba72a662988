"""Stable, compact encoding of protocol messages.

Layout (big-endian), version 1::

    magic  "FT"      2 bytes
    version          u8    (WIRE_VERSION)
    kind             u8    (Message.KIND)
    epoch            u32
    rank             i32   (-1: not a worker)
    incarnation      u64
    step             i64   (-1: none)
    seq              u64
    wall_time        f64
    role             u8
    job length       u16, then the job id in UTF-8
    body             the rest: a JSON object with exactly the kind's body fields

:func:`decode` raises :class:`~fastft.errors.ProtocolError` -- and nothing else -- for any
input that is not a valid message of this version for the expected job.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from fastft.errors import ProtocolError
from fastft.protocol.messages import (
    MESSAGE_TYPES,
    WIRE_VERSION,
    Message,
    Role,
    body_fields,
)

__all__ = ["encode", "decode", "claimed_sender", "MAGIC", "HEADER"]

MAGIC = b"FT"
HEADER = struct.Struct(">2sBBIiQqQdBH")
MAX_MESSAGE = 256 * 1024


def _jsonable(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):  # IntEnum included
        return int(value)
    return value


def encode(msg: Message) -> bytes:
    """Encode ``msg``; raises ProtocolError if it is not a registered message type."""
    cls = type(msg)
    if MESSAGE_TYPES.get(cls.KIND) is not cls:
        raise ProtocolError(f"{cls.__name__} is not a registered message type")
    job = msg.job.encode("utf-8")
    header = HEADER.pack(
        MAGIC,
        WIRE_VERSION,
        cls.KIND,
        msg.epoch,
        msg.rank,
        msg.incarnation,
        msg.step,
        msg.seq,
        msg.wall_time,
        int(msg.role),
        len(job),
    )
    body = {name: _jsonable(getattr(msg, name)) for name in body_fields(cls)}
    return header + job + json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def decode(data: bytes, *, job: str | None = None) -> Message:
    """Decode one message. With ``job`` set, a message of another job is a ProtocolError.

    Raises only :class:`ProtocolError`, whatever ``data`` holds.
    """
    try:
        return _decode(data, job)
    except ProtocolError:
        raise
    except Exception as e:  # struct.error, UnicodeDecodeError, JSON, TypeError, ...
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from e


def _decode(data: bytes, job: str | None) -> Message:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    if len(data) < HEADER.size:
        raise ProtocolError(f"truncated: {len(data)} bytes, header needs {HEADER.size}")
    (magic, version, kind, epoch, rank, inc, step, seq, wall, role, job_len) = HEADER.unpack_from(
        data
    )
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a fastft message")
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {version} is not supported (want {WIRE_VERSION})")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind}")
    end = HEADER.size + job_len
    if len(data) < end:
        raise ProtocolError("truncated job id")
    msg_job = data[HEADER.size : end].decode("utf-8")
    if job is not None and msg_job != job:
        raise ProtocolError(f"message of job {msg_job!r}, expected {job!r}")
    body = json.loads(data[end:].decode("utf-8"))
    if not isinstance(body, dict):
        raise ProtocolError("body is not a JSON object")
    want = set(body_fields(cls))
    if set(body) != want:
        raise ProtocolError(
            f"{cls.__name__} body has fields {sorted(body)}, expected {sorted(want)}"
        )
    try:
        role_value = Role(role)
    except ValueError as e:
        raise ProtocolError(f"unknown role {role}") from e
    return cls(
        job=msg_job,
        epoch=epoch,
        rank=rank,
        incarnation=inc,
        step=step,
        seq=seq,
        wall_time=wall,
        role=role_value,
        **body,
    )


def claimed_sender(data: bytes) -> str:
    """Who a frame says it is from, read from its header without trusting it (for the log
    line of a rejected frame): ``rank R incarnation I role X``, or ``unknown``."""
    try:
        (magic, _, _, _, rank, inc, _, _, _, role, _) = HEADER.unpack_from(bytes(data[:64]))
        if magic != MAGIC:
            return "unknown"
        name = Role(role).name.lower() if role in Role._value2member_map_ else f"role{role}"
        return f"rank {rank} incarnation {inc} {name}"
    except Exception:
        return "unknown"
