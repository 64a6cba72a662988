"""What a scale model run is made of (:mod:`fastft.sim.scale` runs the scenarios): the
plane, keys and secret of one run (:class:`ScaleJob`), the real coordinator with its closes
counted, the result, and :func:`memo` (a view decoded once per run)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import greenlet

from fastft.bus.signed import SignedStore
from fastft.protocol.auth import JobSecret, ValueAuth
from fastft.protocol.keys import JobKeys
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.coordinator import Coordinator
from fastft.sim.costs import Hub, Plane, PlaneCosts, costs
from fastft.sim.modelstore import ModelKV, ModelStore

__all__ = ["CountedCoordinator", "Result", "ScaleJob", "finish", "memo"]


@dataclass
class Result:
    scenario: str
    plane: str
    members: int
    done_s: float | None
    """When the last member was done (None: not within the horizon)."""
    server_busy_s: float
    requests: int
    requests_per_member: float
    critical_requests: int
    mbytes: float
    rejected: int
    repolls: int
    closers: int
    false_deaths: int
    errors: int
    model_wall_s: float
    extra: dict[str, Any]

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return {**d, **self.extra}


def _bytes(raw: str | bytes) -> bytes:
    return raw.encode() if isinstance(raw, str) else bytes(raw)


@contextmanager
def memo() -> Iterator[None]:
    """Within a run, a view or a signed value read by every member is decoded once (what
    is modelled is the servers' time; N members each decoding an N-member view here would
    cost the model O(N^2) of its own time, not the job's)."""
    views = functools.lru_cache(maxsize=64)(EpochView.from_json.__func__)  # type: ignore[attr-defined]
    verify = ValueAuth.verify
    checked = functools.lru_cache(maxsize=1 << 16)(lambda self, key, raw: verify(self, key, raw))
    change = EpochView.from_change.__func__  # type: ignore[attr-defined]
    changes: dict[tuple[int, bytes], Any] = {}

    def from_change(cls: type, prev: EpochView, raw: str | bytes) -> Any:
        key = (id(prev), _bytes(raw))
        if key not in changes:
            changes[key] = change(cls, prev, raw)
        return changes[key]

    EpochView.from_json = classmethod(lambda cls, raw: views(cls, _bytes(raw)))  # type: ignore[assignment,method-assign,arg-type]
    EpochView.from_change = classmethod(from_change)  # type: ignore[assignment,method-assign]
    ValueAuth.verify = lambda self, key, raw: checked(self, key, _bytes(raw))  # type: ignore[method-assign]
    try:
        yield
    finally:
        EpochView.from_json = classmethod(views.__wrapped__)  # type: ignore[assignment,method-assign]
        EpochView.from_change = classmethod(change)  # type: ignore[assignment,method-assign]
        ValueAuth.verify = verify  # type: ignore[method-assign]


class ScaleJob:
    """One model run's plane, keys, secret and per-process request counts."""

    def __init__(self, plane: str, n: int, *, slow: float, secret: bool) -> None:
        self.hub = Hub()
        self.c: PlaneCosts = costs(plane).scaled(slow)
        self.p = Plane(self.hub, self.c)
        self.keys = JobKeys("scale")
        self.auth = ValueAuth(JobSecret(b"s" * 32)) if secret else None
        self.n = n
        self.t0 = time.perf_counter()
        self.by_proc: dict[Any, int] = {}
        base = self.p.request

        def counted(*a: Any, **kw: Any) -> Any:
            g = greenlet.getcurrent()
            self.by_proc[g] = self.by_proc.get(g, 0) + 1
            return base(*a, **kw)

        self.p.request = counted  # type: ignore[method-assign]

    def client(self, i: int, timeout_s: float = 300.0) -> Any:
        kind = ModelKV if self.c.servers > 1 else ModelStore
        raw = kind(self.p, home=i, timeout_s=timeout_s)
        return SignedStore(raw, self.keys, self.auth) if self.auth is not None else raw

    def coordinator(
        self, r: int, expected: int, tries: list[int], dead: set[Member] | None = None
    ) -> CountedCoordinator:
        """Rank ``r``'s real coordinator of epoch 1 (``expected`` members at its start),
        its closes counted in ``tries``."""
        coord = CountedCoordinator(
            self.client(r),
            self.keys,
            r,
            1,
            self.n,
            expected,
            dead=dead,
            clock=self.hub.clock,
            sleep=self.hub.sleep,
            decision_store=self.client(r, 0.5),
        )
        coord.tries, coord.hub = tries, self.hub
        return coord

    def put(self, key: str, value: str) -> None:
        """A key as the job left it (no cost: before the scenario)."""
        if self.auth is not None and self.keys.signed(key):
            value = self.auth.sign(key, value)
        self.p.kv[key] = value.encode()

    def result(self, scenario: str, done: list[float], expected: int, **kw: Any) -> Result:
        return Result(
            scenario=scenario,
            plane=self.c.name,
            members=self.n,
            done_s=round(max(done), 4) if len(done) == expected else None,
            server_busy_s=round(self.p.busy_s(), 4),
            requests=sum(self.p.ops.values())
            - self.p.ops["woken"]
            - self.p.ops["wait_timeout"]
            - self.p.ops["pushed"]
            - self.p.ops["message"],  # (beats: no request, no answer)
            requests_per_member=0.0,
            critical_requests=kw.pop("critical", 0),
            mbytes=round(self.p.bytes / 1e6, 3),
            rejected=self.p.rejected,
            repolls=self.p.ops["wait_timeout"],
            closers=kw.pop("closers", 0),
            false_deaths=kw.pop("false_deaths", 0),
            errors=len(self.hub.errors),
            model_wall_s=round(time.perf_counter() - self.t0, 2),
            extra=kw,
        )


def finish(r: Result) -> Result:
    r.requests_per_member = round(r.requests / max(r.members, 1), 2)
    return r


class CountedCoordinator(Coordinator):
    """The real coordinator, its closes counted (and a NATS closer's joiner keys cleared
    32 at a time by processes of the model, as the coordinator's thread pool does)."""

    tries: list[int]
    hub: Hub

    def close(
        self, view: EpochView, admitted: dict[int, int], prev: EpochView | None = None
    ) -> EpochView:
        self.tries.append(self.me.rank)
        return super().close(view, admitted, prev)

    def clear_joiners(self, admitted: dict[int, int]) -> None:
        if not (self.reads_many and len(admitted) > 1):
            return super().clear_joiners(admitted)
        hub: Hub = self.hub
        left = [len(admitted)]
        me = greenlet.getcurrent()
        items = list(admitted.items())
        width = 32  # (coordinator._CLEARERS: that many at once, as its thread pool)

        def clear(chunk: list[tuple[int, int]]) -> None:
            for r, inc in chunk:
                self.store.compare_set(self.keys.joiner(r), str(inc), "")
                left[0] -= 1
            if left[0] == 0:
                hub.resume_at(hub.now, me)

        for i in range(width):
            hub.spawn(hub.now, functools.partial(clear, items[i::width]))
        hub.suspend()
