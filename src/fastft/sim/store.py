"""The simulator's store: TCPStore's semantics in one dict, with no waiting and no lock.

A ``get`` of a missing key raises at once, as a blocking get whose timeout ran out would:
the simulated members poll (as the real ones do, every 2 ms) instead of blocking, so the
scheduler decides when each read happens. Every operation is counted (per kind), for the
simulator's report and for the control plane's request counts."""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

__all__ = ["SimStore", "StoreDown"]


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class StoreDown(RuntimeError):
    """A store call failed (a fault the simulator injects: a connection reset)."""


class SimStore:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.ops: Counter[str] = Counter()
        self.fail_next = 0
        """Calls that fail before the store answers again (an injected fault)."""

    def _op(self, kind: str, worker: bool = True) -> None:
        self.ops[kind] += 1
        if self.fail_next and worker:
            self.fail_next -= 1
            raise StoreDown(f"store call {kind} failed (injected)")

    def set(self, key: str, value: str | bytes) -> None:
        self._op("set")
        self.kv[key] = _b(value)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._op("multi_set")
        for k, v in zip(keys, values, strict=True):
            self.kv[k] = _b(v)

    def get(self, key: str) -> bytes:
        self._op("get")
        if key not in self.kv:
            raise dist.DistStoreError(f"timeout waiting for key {key!r}")
        return self.kv[key]

    def add(self, key: str, amount: int) -> int:
        self._op("add")
        n = int(self.kv.get(key, b"0")) + amount
        self.kv[key] = str(n).encode()
        return n

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's rule: set ``desired`` if the key holds ``expected`` (a missing key
        counts as holding ``""`` only when ``expected`` is empty); return what it holds."""
        self._op("compare_set")
        cur = self.kv.get(key)
        if (cur is None and _b(expected) == b"") or cur == _b(expected):
            self.kv[key] = _b(desired)
            return _b(desired)
        return cur if cur is not None else _b(expected)

    def check(self, keys: list[str]) -> bool:
        self._op("check")
        return all(k in self.kv for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._op("multi_get")
        missing = [k for k in keys if k not in self.kv]
        if missing:
            raise dist.DistStoreError(f"timeout waiting for keys {missing!r}")
        return [self.kv[k] for k in keys]

    def delete_key(self, key: str) -> bool:
        self._op("delete_key")
        return self.kv.pop(key, None) is not None

    def agent_compare_set(self, key: str, expected: str, desired: str) -> None:
        """An agent's call (the simulator injects store failures into the workers' only)."""
        self._op("compare_set", worker=False)
        if self.kv.get(key, b"").decode() == expected:
            self.kv[key] = desired.encode()

    def value(self, key: str) -> str | None:
        """For the checks (not counted, never fails)."""
        got = self.kv.get(key)
        return None if got is None else got.decode(errors="replace")
