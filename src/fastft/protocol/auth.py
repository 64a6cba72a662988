"""The job secret, and what it authenticates: control messages and control-plane values.

Every process of a job holds one secret (:class:`JobSecret`): ``fastft run`` draws it on a
single node, or reads ``--job-secret-file`` (one file every node shares). It reaches
workers as a file of mode 0600 whose *path* is in ``FASTFT_SECRET_FILE``; the secret never
goes into argv, the environment or the event log.

From it come two keys (HMAC-SHA256 with a label: a key for one purpose is no key for the
other):

* **bus frames** (:class:`MessageAuth`): an encoded message, then the sending endpoint's
  8-byte nonce, then a 16-byte tag over both. A frame whose tag does not check is
  :class:`Forged`. :class:`ReplayGuard` then drops a valid frame seen before: per sending
  stream (role, rank, incarnation, nonce) sequence numbers only go up (the bus is FIFO per
  publisher), and a stream a receiver never saw must be younger than the receiver's own
  start minus ``SKEW_S``.
* **store values** (:class:`ValueAuth`): ``value#tag`` with the tag over the key and the
  value, so a value signed for one key is no value for another. ``""`` (a cleared key)
  carries none. A value whose tag does not check is read as no value at all.

Counters (``add``) cannot carry a tag (docs/security.md says what a forged count can do).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections import OrderedDict
from pathlib import Path

from fastft.errors import ConfigError, ProtocolError

__all__ = [
    "Forged",
    "JobSecret",
    "MessageAuth",
    "NONCE_BYTES",
    "ReplayGuard",
    "SKEW_S",
    "TAG_BYTES",
    "ValueAuth",
]

TAG_BYTES = 16
"""HMAC-SHA256 truncated to 128 bits (RFC 2104 section 5; what TLS and IPsec use)."""
NONCE_BYTES = 8
SECRET_MIN_BYTES = 16
SKEW_S = 30.0
"""How far the clocks of two hosts of a job may disagree (a stream first seen by a
receiver may be this much older than the receiver itself)."""
_SENDERS = 4096
"""Sending streams a :class:`ReplayGuard` remembers (the least recently heard go first)."""


class Forged(ProtocolError):
    """Bytes that do not carry a valid tag of this job's secret."""


class JobSecret:
    """The job's shared secret. Its ``repr`` never shows it."""

    def __init__(self, raw: bytes) -> None:
        if len(raw) < SECRET_MIN_BYTES:
            raise ConfigError(
                f"the job secret has {len(raw)} bytes: use at least {SECRET_MIN_BYTES} "
                "(fastft secret new PATH writes one)"
            )
        self._raw = bytes(raw)

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    def key(self, purpose: str) -> bytes:
        """The key for one purpose (``bus``, ``store``, ``nats``)."""
        return hmac.digest(self._raw, b"fastft/v1/" + purpose.encode(), "sha256")

    @classmethod
    def draw(cls) -> JobSecret:
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> JobSecret:
        """Read a secret file; it must be a regular file nobody but its owner can read."""
        p = Path(path)
        try:
            st = p.stat()
        except OSError as e:
            raise ConfigError(
                f"job secret file {p}: {e.strerror or e} (create one with: fastft secret new PATH)"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"job secret file {p}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"job secret file {p} has mode {stat.S_IMODE(st.st_mode):o}: others can read "
                f"it; run: chmod 600 {p}"
            )
        return cls(p.read_bytes().strip())

    @classmethod
    def for_worker(cls, path: str | os.PathLike[str] | None) -> JobSecret:
        """The secret a worker was handed; a ConfigError that says how to get one if none."""
        if not path:
            raise ConfigError(
                "no job secret: start the script with `fastft run` (it hands every worker "
                "the job's secret), or pass secret_file= (a file of mode 0600 every process "
                "of the job shares; fastft secret new PATH writes one)"
            )
        return cls.load(path)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the secret to a new file of mode 0600 (an existing file is an error)."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"{p} exists: the job secret goes into a new file") from None
        with os.fdopen(fd, "wb") as f:
            f.write(self._raw + b"\n")
        return p


class MessageAuth:
    """Seals and opens bus frames with the job's bus key."""

    TRAILER = NONCE_BYTES + TAG_BYTES

    def __init__(self, secret: JobSecret) -> None:
        self._key = secret.key("bus")

    def seal(self, data: bytes, nonce: bytes) -> bytes:
        body = data + nonce
        return body + hmac.digest(self._key, body, "sha256")[:TAG_BYTES]

    def open(self, frame: bytes) -> tuple[bytes, bytes]:
        """``(encoded message, nonce)``; raises :class:`Forged` if the tag does not check."""
        if len(frame) <= self.TRAILER:
            raise Forged(f"a frame of {len(frame)} bytes has no room for a tag")
        body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(hmac.digest(self._key, body, "sha256")[:TAG_BYTES], tag):
            raise Forged("the frame's tag does not match the job secret")
        return body[:-NONCE_BYTES], body[-NONCE_BYTES:]


class ReplayGuard:
    """Rejects a valid frame received before (pure; the caller supplies the clock)."""

    def __init__(self, started_at: float, senders: int = _SENDERS) -> None:
        self.started_at = started_at
        self._last: OrderedDict[tuple[int, int, int, bytes], int] = OrderedDict()
        self._cap = senders

    def check(self, stream: tuple[int, int, int, bytes], seq: int, wall_time: float) -> str | None:
        """None if the frame is new (and remember it); else why it is a replay."""
        last = self._last.get(stream)
        if last is None:
            if wall_time < self.started_at - SKEW_S:
                return (
                    f"first frame of a sender, sent {self.started_at - wall_time:.0f} s before "
                    "this receiver started"
                )
        elif seq <= last:
            return f"sequence number {seq} after {last}"
        self._last[stream] = seq
        self._last.move_to_end(stream)
        if len(self._last) > self._cap:
            self._last.popitem(last=False)
        return None


class ValueAuth:
    """Signs and checks control-plane values with the job's store key."""

    SEP = "#"

    def __init__(self, secret: JobSecret) -> None:
        self._key = secret.key("store")

    def _tag(self, key: str, value: str) -> str:
        msg = key.encode() + b"\x00" + value.encode("utf-8", "surrogatepass")
        return hmac.digest(self._key, msg, "sha256")[:TAG_BYTES].hex()

    def sign(self, key: str, value: str) -> str:
        return "" if value == "" else f"{value}{self.SEP}{self._tag(key, value)}"

    def verify(self, key: str, raw: bytes | str) -> str | None:
        """The value, or None when ``raw`` carries no valid tag for ``key`` (``""`` is
        ``""``: a cleared key)."""
        text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
        if text == "":
            return ""
        value, sep, tag = text.rpartition(self.SEP)
        got = tag.encode("utf-8", "surrogateescape")  # (bytes: any text compares, no error)
        if not sep or not hmac.compare_digest(got, self._tag(key, value).encode()):
            return None
        return value


def fingerprint(secret: JobSecret) -> str:
    """A short public id of a secret (for banners: which secret a process holds)."""
    return hashlib.sha256(secret.key("fingerprint")).hexdigest()[:12]
