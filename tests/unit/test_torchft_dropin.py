"""ManagerFFT as a drop-in torchft Manager (issue 20): native process groups, waits that
honour their timeout, quorum leases only where joins are announced, and the bus under any
launcher (``connect``). No processes: torchft's Manager constructor is stubbed."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

pytest.importorskip("torchft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchft import ProcessGroupGloo  # noqa: E402
from torchft.manager import Manager  # noqa: E402

from fastft.errors import ConfigError  # noqa: E402
from fastft.integrations.torchft import ManagerFFT, connect  # noqa: E402
from fastft.integrations.torchft.manager import QUORUM_EVERY  # noqa: E402
from fastft.integrations.torchft.pg import BusWork, Pending, aborts_release_waiters  # noqa: E402
from fastft.process.env import WORKER_VARS  # noqa: E402


class _Stop(Exception):
    pass


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """torchft's Manager.__init__ records what it was given, then stops."""
    got: dict[str, Any] = {}

    def fake_init(self: Manager, pg: Any, *args: Any, **kwargs: Any) -> None:
        got.update(kwargs, pg=pg)
        raise _Stop

    monkeypatch.setattr(Manager, "__init__", fake_init)
    for name in WORKER_VARS.values():
        monkeypatch.delenv(name, raising=False)
    return got


def test_a_native_process_group_is_passed_through_to_torchfts_own_checks(seen):
    native = dist.ProcessGroup(dist.HashStore(), 0, 1)
    bus = connect("127.0.0.1:1", "j")
    with pytest.raises(_Stop):
        ManagerFFT(pg=native, bus=bus, load_state_dict=None, state_dict=None, min_replica_size=1)
    assert seen["pg"] is native  # torchft checks supports_reconfigure itself


def test_without_a_bus_the_group_is_torchfts_own(seen):
    pg = ProcessGroupGloo()
    with pytest.raises(_Stop):
        ManagerFFT(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1)
    assert seen["pg"] is pg  # nothing to relay: no wrapper (torchft's tests mock its group)


def test_a_native_group_without_reconfigure_gets_torchfts_own_message(monkeypatch):
    for name in WORKER_VARS.values():
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="enable_reconfigure=True"):
        ManagerFFT(
            pg=dist.ProcessGroup(dist.HashStore(), 0, 1),
            bus=connect("127.0.0.1:1", "j"),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
        )


def test_a_group_that_cannot_name_its_backend_is_wrapped_not_a_crash():
    class Unnamed:
        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            raise RuntimeError("not configured")

    assert aborts_release_waiters(Unnamed()) is False  # type: ignore[arg-type]
    assert aborts_release_waiters(ProcessGroupGloo()) is False


class _Work(dist._Work):
    """A work whose future completes only when told, and whose wait is recorded."""

    def __init__(self, completed: bool, fut: torch.futures.Future[Any] | None = None) -> None:
        super().__init__()
        self.completed = completed
        self.fut = fut if fut is not None else torch.futures.Future()
        self.waits: list[Any] = []

    def get_future(self) -> torch.futures.Future[Any]:
        return self.fut

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: Any = None) -> bool:
        self.waits.append(timeout)
        if not self.completed:
            raise RuntimeError(f"timed out after {timeout}")
        return True


def test_wait_passes_the_timeout_to_the_work_and_returns_when_the_work_completed():
    work = _Work(completed=True)  # its future never completes (torchft's late future)
    t = datetime.timedelta(seconds=5)
    assert BusWork(work, Pending()).wait(t) is True
    assert work.waits == [t]
    assert BusWork(work, Pending()).wait() is True
    assert work.waits == [t, None]  # no timeout: the argument is left out


class _NoCallbacks(torch.futures.Future):  # type: ignore[type-arg]
    """A work's future that records Python callbacks attached to it."""

    def __init__(self) -> None:
        super().__init__()
        self.thens = 0

    def then(self, callback: Any) -> Any:  # type: ignore[override]
        self.thens += 1
        return super().then(callback)


def test_no_python_callback_on_the_works_future_when_it_is_waited_for():
    # A Gloo thread that runs (or frees) a Python callback while the interpreter finalizes
    # aborts the process: the work is polled instead.
    fut = _NoCallbacks()
    work = _Work(completed=False, fut=fut)
    w = BusWork(work, Pending())
    assert not w.is_completed()
    fut.set_result(["t"])
    work.completed = True
    assert w.wait() is True
    assert w.get_future().value() == ["t"]
    assert fut.thens == 0


def test_a_collective_failure_reaches_the_future_without_a_callback():
    fut = _NoCallbacks()
    work = _Work(completed=True, fut=fut)
    fut.set_exception(RuntimeError("Connection closed by peer"))
    w = BusWork(work, Pending())
    with pytest.raises(RuntimeError, match="closed by peer"):
        w.wait()
    assert fut.thens == 0


def test_the_future_asked_for_before_completion_still_completes():
    fut = _NoCallbacks()
    work = _Work(completed=False, fut=fut)
    f = BusWork(work, Pending()).get_future()
    fut.set_result(["t"])
    assert f.wait() == ["t"]


def test_wait_reports_the_works_own_timeout_error():
    work = _Work(completed=False)
    with pytest.raises(RuntimeError, match="timed out"):
        BusWork(work, Pending()).wait(datetime.timedelta(milliseconds=20))


def test_a_bus_fault_ends_the_wait():
    work = _Work(completed=False)
    pending = Pending()
    w = BusWork(work, pending)
    pending.fail_all(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        w.wait()
    assert work in pending.abandoned and pending.dirty


def test_leases_are_on_by_default_only_where_joins_are_announced(monkeypatch, seen):
    made: list[ManagerFFT] = []

    def fake_init(self: Manager, pg: Any, *args: Any, **kwargs: Any) -> None:
        self._pg = pg
        self._client = object()
        made.append(self)  # type: ignore[arg-type]

    monkeypatch.setattr(Manager, "__init__", fake_init)
    started: list[Any] = []
    monkeypatch.setattr(
        "fastft.integrations.torchft.manager.connect_store", lambda addr: started.append(addr)
    )
    monkeypatch.setattr(
        "fastft.integrations.torchft.manager.Services.start",
        lambda *a, **kw: (_ for _ in ()).throw(_Stop()),
    )
    for announces, want in ((False, 1), (True, QUORUM_EVERY)):
        bus = connect("127.0.0.1:1", "j", replica=0, replicas=2, announces_joins=announces)
        with pytest.raises(_Stop):
            ManagerFFT(pg=ProcessGroupGloo(), bus=bus, world_size=1)
        assert made[-1].lease.quorum_every == want
    with pytest.raises(_Stop):  # asked for explicitly: honoured
        ManagerFFT(pg=ProcessGroupGloo(), bus=connect("127.0.0.1:1", "j"), quorum_every=8)
    assert made[-1].lease.quorum_every == 8


def test_connect_reads_torchfts_variables_and_checks_its_arguments():
    bus = connect("h:1", "job", env={"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "4"})
    assert (bus.rank, bus.world_size, bus.store, bus.job) == (2, 4, "h:1", "job")
    assert connect("h:1", "job", env={"RANK": "1"}).rank == 1
    for kw, match in (
        ({"store": "nohost"}, "HOST:PORT"),
        ({"job": "a/b"}, "without '/'"),
        ({"replica": 5, "replicas": 2}, "out of range"),
    ):
        args = {"store": "h:1", "job": "j", **kw}
        with pytest.raises(ConfigError, match=match):
            connect(args.pop("store"), args.pop("job"), env={}, **args)
