"""The agent's warm spares on a GPU machine: each warms the GPU of the worker it is likely to
replace, and a restart takes a spare that warmed the dead worker's GPU when there is one.
(The warming itself runs on GPU machines: bench/gpu_check.py.) A spare that runs the script
ahead (``--spare-run-ahead``) waits in ``fastft.init()`` and becomes the worker it is
ordered to be, or ends there when it is not needed."""

from __future__ import annotations

from types import SimpleNamespace

from fastft.launch.procs.spares import SparePool
from fastft.process.env import SPARE_RUN_AHEAD
from fastft.process.order import await_order


def _pool(
    spares: dict[int, int | None],
    gpus: int = 2,
    dead: set[int] = frozenset(),
    ready: set[int] | None = None,
) -> SparePool:
    """A pool of stand-in spares: the pairing only, no processes."""
    pool = SparePool(None, None, reap=lambda pid: None, preexec=lambda: None, gpus=gpus)  # type: ignore[arg-type]
    for pid, gpu in spares.items():
        pool.track(SimpleNamespace(pid=pid), gpu)
        if ready is None or pid in ready:
            pool.mark_ready(pid)
    for pid in dead:
        assert pool.mark_dead(pid)
    return pool


def _pid(taken):
    return None if taken is None else taken[0].pid


def test_a_restart_takes_the_spare_that_warmed_its_gpu():
    a = _pool({10: 0, 11: 1, 12: 0})
    assert _pid(a.take(1)) == 11
    assert _pid(a.take(1)) == 10  # none left for GPU 1: any live spare
    assert _pid(a.take(0)) == 12
    assert a.take(0) is None
    assert not a


def test_dead_spares_are_skipped_and_a_cpu_job_takes_them_in_order():
    a = _pool({10: None, 11: None, 12: None}, gpus=0, dead={10})
    assert [_pid(a.take()), _pid(a.take()), a.take()] == [11, 12, None]


def test_a_restart_prefers_a_spare_that_is_ready():
    """A spare still warming up has its imports left: a ready one goes first (after the
    GPU it warmed), and the restart learns whether it got a ready one."""
    a = _pool({10: None, 11: None, 12: None}, gpus=0, ready={11})
    spare, ready = a.take()
    assert (spare.pid, ready) == (11, True)
    assert a.take()[0].pid == 10  # none ready: the oldest
    b = _pool({10: 0, 11: 1, 12: 0}, ready={10, 11})
    assert [(p.pid, r) for p, r in [b.take(0), b.take(0)]] == [(10, True), (12, False)]


def test_workers_map_to_gpus_as_torchrun_places_them():
    a = _pool({}, gpus=4)
    assert [a.gpu_of(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert _pool({}, gpus=0).gpu_of(3) is None  # no GPU: spares warm none


def test_await_order_is_a_no_op_in_a_worker(monkeypatch):
    monkeypatch.delenv(SPARE_RUN_AHEAD, raising=False)
    await_order()  # returns at once: no stdin read
