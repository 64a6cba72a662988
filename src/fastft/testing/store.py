"""An in-memory stand-in for ``torch.distributed.TCPStore``: the calls fastft's
coordinator, bus and key collector make (``set``, ``get`` with a timeout, ``add``,
``compare_set``, ``check``, ``multi_get``, ``delete_key``, ``clone``, ``set_timeout``),
shared by every clone, thread-safe. For tests of formation and agreement without
processes; process groups need a real store."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

__all__ = ["CountingStore", "MemoryStore"]


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class _Data:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.cond = threading.Condition()


class MemoryStore:
    """``clone()`` returns a client on the same data (with its own timeout)."""

    def __init__(self, timeout_s: float = 30.0, _data: _Data | None = None) -> None:
        self._d = _data if _data is not None else _Data()
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def clone(self) -> MemoryStore:
        return MemoryStore(self.timeout.total_seconds(), self._d)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout

    def set(self, key: str, value: str | bytes) -> None:
        with self._d.cond:
            self._d.kv[key] = _b(value)
            self._d.cond.notify_all()

    def get(self, key: str) -> bytes:
        """Blocks until ``key`` exists; raises ``DistStoreError`` after the timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._d.cond:
            while key not in self._d.kv:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(f"timeout waiting for key {key!r}")
                self._d.cond.wait(left)
            return self._d.kv[key]

    def add(self, key: str, amount: int) -> int:
        with self._d.cond:
            n = int(self._d.kv.get(key, b"0")) + amount
            self._d.kv[key] = str(n).encode()
            self._d.cond.notify_all()
            return n

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's rule: set ``desired`` if the key holds ``expected`` (a missing key
        counts as holding ``""`` only when ``expected`` is empty); return what it holds."""
        with self._d.cond:
            cur = self._d.kv.get(key)
            if (cur is None and _b(expected) == b"") or cur == _b(expected):
                self._d.kv[key] = _b(desired)
                self._d.cond.notify_all()
                return _b(desired)
            return cur if cur is not None else _b(expected)

    def check(self, keys: list[str]) -> bool:
        with self._d.cond:
            return all(k in self._d.kv for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def delete_key(self, key: str) -> bool:
        with self._d.cond:
            return self._d.kv.pop(key, None) is not None

    def keys(self) -> list[str]:
        """Every key (for tests' checks; not in TCPStore's API)."""
        with self._d.cond:
            return list(self._d.kv)


class CountingStore:
    """Any store client, its method calls counted by name in ``counts`` (shared with its
    clones and across threads): how many requests a piece of code makes."""

    def __init__(
        self,
        inner: object,
        counts: dict[str, int] | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self._inner = inner
        self.counts: dict[str, int] = counts if counts is not None else {}
        self._lock = lock if lock is not None else threading.Lock()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def clone(self) -> CountingStore:
        return CountingStore(self._inner.clone(), self.counts, self._lock)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*a: object, **kw: object) -> object:
            with self._lock:
                self.counts[name] = self.counts.get(name, 0) + 1
            return attr(*a, **kw)

        return call
