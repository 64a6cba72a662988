"""The store clients of the scale model's plane (:mod:`fastft.sim.costs`): a TCPStore's
(:class:`ModelStore`) and a NATS bucket's (:class:`ModelKV`), each request charged its
round trip and its server's time. The calls are those the coordinator, the survivors and
the leases make."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from fastft.sim.costs import Plane, Server, Watch

__all__ = ["ModelKV", "ModelStore"]


_MISSING = object()


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class ModelStore:
    """A TCPStore client on the model's plane (the calls the coordinator, the survivors
    and the leases make)."""

    def __init__(self, plane: Plane, home: int = 0, timeout_s: float = 300.0) -> None:
        self.p = plane
        self.home = plane.servers[home % len(plane.servers)]
        self.timeout_s = timeout_s

    def clone(self) -> ModelStore:
        return type(self)(self.p, self.p.servers.index(self.home), self.timeout_s)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def _w(self) -> Server:
        """Where a write is ordered (TCPStore: its one thread; NATS: the stream's leader)."""
        return self.home if self.p.c.servers == 1 else self.p.leader

    def _put(self, key: str, value: bytes) -> None:
        self.p.kv[key] = value
        self.p.written(key, self._w())

    def set(self, key: str, value: str | bytes) -> None:
        v = _b(value)
        self.p.request(self._w(), "set", self.p.c.set_s, lambda: self._put(key, v), len(v))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """TCPStore: one request; NATS: a put per key at the leader, sent at once."""
        vs = [_b(v) for v in values]
        per = self.p.c.set_s if self.p.c.servers > 1 else self.p.c.per_key_s
        cost = self.p.c.set_s + per * (len(keys) - 1)

        def apply() -> None:
            for k, v in zip(keys, vs, strict=True):
                self._put(k, v)

        self.p.request(self._w(), "multi_set", cost, apply, sum(map(len, vs)))

    def get(self, key: str) -> bytes:
        self.p.wait_key(self.home, key, self.timeout_s)
        return self.p.request(self.home, "get", self.p.c.get_s, lambda: self.p.kv[key])

    def add(self, key: str, amount: int) -> int:
        def apply() -> int:
            n = int(self.p.kv.get(key, b"0")) + amount
            self._put(key, str(n).encode())
            return n

        return self.p.request(self._w(), "add", self.p.c.add_s, apply)

    def check(self, keys: list[str]) -> bool:
        cost = self.p.c.check_s + self.p.c.per_key_s * (len(keys) - 1)
        return self.p.request(self.home, "check", cost, lambda: all(k in self.p.kv for k in keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        for k in keys:
            if k not in self.p.kv:
                self.p.wait_key(self.home, k, self.timeout_s)
        cost = self.p.c.get_s + self.p.c.per_key_s * (len(keys) - 1)
        return self.p.request(self.home, "multi_get", cost, lambda: [self.p.kv[k] for k in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        want, new = _b(expected), _b(desired)

        def apply() -> bytes:
            cur = self.p.kv.get(key)
            if (cur is None and want == b"") or cur == want:
                self._put(key, new)
                return new
            self.p.rejected += 1
            return cur if cur is not None else want

        return self.p.request(self._w(), "compare_set", self.p.c.compare_set_s, apply, len(new))

    def delete_key(self, key: str) -> bool:
        return self.p.request(
            self._w(), "delete", self.p.c.set_s, lambda: self.p.kv.pop(key, None) is not None
        )


class ModelKV(ModelStore):
    """A NATS key-value client (:class:`fastft.bus.nats.NatsKV`'s requests) on the model's
    plane: a read goes to the client's server, a write to the stream's leader; ``add`` and
    a compare-and-set read the key's revision and write expecting it (a write that lost
    is tried again: counted as rejected); ``read_many`` is one round trip of reads."""

    def _read(self, key: str) -> tuple[bytes | None, int]:
        got = self.p.request(
            self.home, "get", self.p.c.get_s, lambda: (self.p.kv.get(key), self.p.rev[key])
        )
        return got

    def _write_if(self, key: str, value: bytes, rev: int) -> bool:
        def apply() -> bool:
            if self.p.rev[key] != rev:
                self.p.rejected += 1
                return False
            self._put(key, value)
            return True

        return self.p.request(self.p.leader, "write", self.p.c.set_s, apply, len(value))

    def get(self, key: str) -> bytes:
        v, _ = self._read(key)
        if v is None:  # (a subscription to the key's writes, then the wait, then a read)
            self.p.request(self.home, "subscribe", self.p.c.push_s, lambda: None)
            try:
                self.p.wait_key(self.home, key, self.timeout_s)
            except dist.DistStoreError:
                v, _ = self._read(key)  # (NatsKV reads once more before it gives up)
                if v is None:
                    raise
            v, _ = self._read(key)
        assert v is not None
        return v

    def add(self, key: str, amount: int) -> int:
        while True:
            v, rev = self._read(key)
            n = int(v or b"0") + amount
            if self._write_if(key, str(n).encode(), rev):
                return n

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        want, new = _b(expected), _b(desired)
        if not want and self._write_if(key, new, 0):
            return new
        while True:
            v, rev = self._read(key)
            if v is None and want:
                return want
            cur = v or b""
            if v is not None and cur != want:
                return cur
            if self._write_if(key, new, rev):
                return new

    def check(self, keys: list[str]) -> bool:
        return all(self._read(k)[0] is not None for k in keys)

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        cost = self.p.c.get_s + self.p.c.per_key_s * (len(keys) - 1)
        return self.p.request(
            self.home, "read_many", cost, lambda: [self.p.kv.get(k) for k in keys]
        )

    def watch(self, prefix: str) -> Watch:
        """Every value under ``prefix``, now and as written (one request: a consumer of
        the keys' last values; each then a push from this client's server)."""
        w = Watch(prefix, self.home)

        def apply() -> None:
            self.p.watches.append(w)
            for k in [k for k in self.p.kv if k.startswith(prefix)]:
                self.p.push(w, k)

        self.p.request(self.home, "watch", self.p.c.get_s, apply)
        return w

    def read_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every value under ``prefix`` (one request: a watch's last values, each pushed,
        then its end)."""
        w = self.watch(prefix)  # (its answer comes after the pushes of what is there)
        w.close()
        return dict(w.seen)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = self.read_many(keys)
        return [v if v is not None else self.get(k) for v, k in zip(got, keys, strict=True)]
