"""A store client that signs the control plane's values and checks them when it reads.

Wraps a job's store client (TCPStore or NATS) for the runtime's coordinator and the
agents' leases. Keys :meth:`fastft.protocol.keys.JobKeys.signed` names (decisions, epoch
member lists, arrivals, joiners, node marks...) are written as ``value#tag``
(:class:`fastft.protocol.auth.ValueAuth`) and read back as ``value``; a value there without
a valid tag raises :class:`ForgedValue`, which carries the raw bytes so that a proposer can
replace a forgery that pre-empted a decision (:meth:`replace`). Every other key (counters,
the bus's queues, the process groups' rendezvous) passes through untouched.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from fastft.errors import ControlPlaneError
from fastft.protocol.auth import ValueAuth
from fastft.protocol.keys import JobKeys

__all__ = ["ForgedValue", "SignedStore", "SignedWatch"]

log = logging.getLogger(__name__)


class ForgedValue(ControlPlaneError):
    """A signed key holds a value without a valid tag of the job secret."""

    def __init__(self, key: str, raw: bytes) -> None:
        super().__init__(
            f"store key {key} holds a value without the job secret's tag ({raw[:40]!r}): "
            "something that is not part of this job wrote it; it is not applied"
        )
        self.key = key
        self.raw = raw


class _Counts:
    """Forged values seen, per key kind, shared by a client and its clones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, int] = {}

    def add(self, key: str) -> int:
        with self.lock:
            n = self.by_key.get(key, 0) + 1
            self.by_key[key] = n
            return n

    @property
    def total(self) -> int:
        return sum(self.by_key.values())


class SignedStore:
    """``store`` with the values of signed keys signed and checked (see the module)."""

    def __init__(
        self,
        store: Any,
        keys: JobKeys,
        auth: ValueAuth,
        counts: _Counts | None = None,
        *,
        insecure: bool = False,
    ) -> None:
        """``insecure``: pass every value through (FASTFT_INSECURE_NO_AUTH)."""
        self.raw = store
        self.keys = keys
        self.auth = auth
        self.forged = counts if counts is not None else _Counts()
        self.insecure = insecure

    def __getattr__(self, name: str) -> Any:  # add, check, delete_key, set_timeout, wait...
        return getattr(self.raw, name)

    def clone(self) -> SignedStore:
        return SignedStore(
            self.raw.clone(), self.keys, self.auth, self.forged, insecure=self.insecure
        )

    def _out(self, key: str, value: str | bytes) -> str:
        text = value.decode() if isinstance(value, bytes) else value
        return self.auth.sign(key, text) if self.keys.signed(key) and not self.insecure else text

    def verified(self, key: str, raw: Any) -> bytes:
        raw = bytes(raw)
        if not self.keys.signed(key) or self.insecure:
            return raw
        got = self.auth.verify(key, raw)
        if got is None:
            if self.forged.add(key) == 1:
                log.error("store: %s", ForgedValue(key, raw))
            raise ForgedValue(key, raw)
        return got.encode("utf-8", "surrogateescape")

    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self._out(key, value))

    def get(self, key: str) -> bytes:
        return self.verified(key, self.raw.get(key))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.raw.multi_set(keys, [self._out(k, v) for k, v in zip(keys, values, strict=True)])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        exp = self._out(key, expected)
        return self.verified(key, self.raw.compare_set(key, exp, self._out(key, desired)))

    def replace(self, key: str, forged: bytes, desired: str) -> bytes:
        """Compare-and-set over a forged value (one that pre-empted a decision is none)."""
        return self.verified(key, self.raw.compare_set(key, forged, self._out(key, desired)))

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """Values or None (absent, or forged: counted) of ``keys``, where the store reads
        many at once (NATS); AttributeError where it does not."""
        out: list[bytes | None] = []
        for k, raw in zip(keys, self.raw.read_many(keys), strict=True):
            try:
                out.append(None if raw is None else self.verified(k, raw))
            except ForgedValue:
                out.append(None)
        return out

    def read_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every value under ``prefix`` whose tag holds (NATS; a forged one left out, and
        counted)."""
        return SignedWatch(self, _Fixed(self.raw.read_prefix(prefix))).values()

    def watch(self, prefix: str) -> SignedWatch:
        """The store's watch of ``prefix`` (NATS), its values checked as they are read."""
        return SignedWatch(self, self.raw.watch(prefix))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Values of ``keys``; a forged one reads as ``b""`` (no value), and is counted."""
        out = []
        for k, raw in zip(keys, self.raw.multi_get(keys), strict=True):
            try:
                out.append(self.verified(k, raw))
            except ForgedValue:
                out.append(b"")
        return out


class SignedWatch:
    """A watch's values with their tags checked (a forged one is left out, and counted);
    each value checked once."""

    def __init__(self, store: SignedStore, watch: Any) -> None:
        self.store = store
        self.w = watch
        self._checked: dict[str, tuple[bytes, bytes | None]] = {}

    def values(self) -> dict[str, bytes]:
        out = {}
        for k, raw in list(self.w.values().items()):
            got = self._checked.get(k)
            if got is None or got[0] != raw:
                try:
                    got = (raw, self.store.verified(k, raw))
                except ForgedValue:
                    got = (raw, None)
                self._checked[k] = got
            if got[1] is not None:
                out[k] = got[1]
        return out

    def close(self) -> None:
        self.w.close()


class _Fixed:
    def __init__(self, values: dict[str, bytes]) -> None:
        self._values = values

    def values(self) -> dict[str, bytes]:
        return self._values

    def close(self) -> None:
        pass
