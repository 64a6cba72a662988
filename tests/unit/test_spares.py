"""The agent's warm spares on a GPU machine: each warms the GPU of the worker it is likely to
replace, and a restart takes a spare that warmed the dead worker's GPU when there is one.
(The warming itself runs on GPU machines: bench/gpu_check.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from fastft.launch.agent import Agent


def _agent(spares: dict[int, int | None], gpus: int = 2, dead: set[int] = frozenset()):
    a = Agent.__new__(Agent)  # the pairing only: no store, no processes
    a._lock = threading.Lock()
    a._gpus = gpus
    a._spares = [SimpleNamespace(pid=pid) for pid in spares]
    a._spare_gpu = {pid: g for pid, g in spares.items() if g is not None}
    a._dead_spares = set(dead)
    return a


def test_a_restart_takes_the_spare_that_warmed_its_gpu():
    a = _agent({10: 0, 11: 1, 12: 0})
    assert a._take_spare(1).pid == 11
    assert a._take_spare(1).pid == 10  # none left for GPU 1: any live spare
    assert a._take_spare(0).pid == 12
    assert a._take_spare(0) is None
    assert a._spare_gpu == {}


def test_dead_spares_are_skipped_and_a_cpu_job_takes_them_in_order():
    a = _agent({10: None, 11: None, 12: None}, gpus=0, dead={10})
    assert [a._take_spare().pid, a._take_spare().pid, a._take_spare()] == [11, 12, None]


def test_workers_map_to_gpus_as_torchrun_places_them():
    a = _agent({}, gpus=4)
    assert [a._gpu_of(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert _agent({}, gpus=0)._gpu_of(3) is None  # no GPU: spares warm none
