"""The heartbeat's pace: how long a worker's main thread is silent in a clean step, which
the agent scales into its hang timeout (:func:`fastft.process.heartbeat.hang_limit`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastft.process import heartbeat
from fastft.process.beat import (
    HANG_FLOOR_S,
    HANG_PACES,
    PACE_WINDOW,
    Wait,
    hang_limit,
    pace_of,
    read_heartbeat,
)
from fastft.process.heartbeat import HeartbeatWriter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(heartbeat.time, "monotonic", c)
    return c


def step(
    hb: HeartbeatWriter,
    clock: Clock,
    compute: float,
    *,
    wait: float = 0.5,
    clean: bool = True,
    between: float = 0.0,
) -> None:
    """One step as the runtime beats it: enter, compute (silent), the collective's wait
    (the helper beats), commit, then ``between`` seconds of the user's code."""
    hb.between(False)
    hb.beat()
    clock.now += compute
    with hb.blocked:
        clock.now += wait
    hb.beat()
    hb.committed(clean=clean)
    hb.between(True)
    clock.now += between


def test_the_pace_is_the_compute_not_the_waits_the_time_between_steps_or_recoveries(
    tmp_path: Path, clock: Clock
) -> None:
    path = str(tmp_path / "hb")
    hb = HeartbeatWriter(path)
    try:
        step(hb, clock, 3.0)  # the life's first step warms up: not its pace
        b = read_heartbeat(path)
        assert b is not None and b.pace == 0.0 and b.commits == 1 and hb.tracking
        step(hb, clock, 0.05, wait=2.0, between=30.0)  # a slow peer, a long evaluation
        assert hb.pace == pytest.approx(0.05)
        step(hb, clock, 4.0, clean=False)  # a step that recovered: its silences are not steps
        assert hb.pace == pytest.approx(0.05)
        b = read_heartbeat(path)
        assert b is not None and b.pace == pytest.approx(0.05) and b.commits == 3
    finally:
        hb.close()
    b = read_heartbeat(path)  # closed: a last beat in the future, the commits kept
    assert b is not None and b.last > clock.now and b.commits == 3


def test_a_step_after_a_recovery_or_a_new_epoch_is_judged_by_the_hang_timeout(
    tmp_path: Path, clock: Clock
) -> None:
    # JAX compiles its step again for an elastic world's new shapes: seconds in a step of
    # 30 ms (test-jax's elastic run had such a worker killed as hung by its pace)
    path = str(tmp_path / "hb")
    hb = HeartbeatWriter(path)
    try:
        for _ in range(3):
            step(hb, clock, 0.03)
        assert hb.pace == pytest.approx(0.03)
        hb.unsettle()  # a new epoch (or a rollback)
        b = read_heartbeat(path)
        # the agent: the pace still judges silence (a GIL hang, a stop), the step's
        # length is judged from `unsettled` by --hang-timeout; in the process (ft.run's
        # watchdog, which cannot tell a compile from a hang) the pace reads 0
        assert b is not None and b.pace == pytest.approx(0.03) and b.unsettled == clock.now
        assert hb.pace == 0.0 and hang_limit(hb.pace, 30.0) == 30.0
        step(hb, clock, 4.0)  # the new world's first step compiles: a clean commit...
        step(hb, clock, 3.0)  # (its second, another share of the batch: again)
        b = read_heartbeat(path)
        assert b is not None and b.unsettled == clock.now and hb.pace == 0.0
        step(hb, clock, 0.03)
        assert hb.pace == pytest.approx(0.03)  # ...settled again, their silences not the pace
        b = read_heartbeat(path)
        assert b is not None and b.pace == pytest.approx(0.03) and b.unsettled == 0.0
    finally:
        hb.close()


def test_one_outlier_in_the_window_is_not_the_pace() -> None:
    assert pace_of([]) == 0.0
    assert pace_of([0.05, 0.2]) == 0.2  # few steps: the largest
    window = [0.05] * (PACE_WINDOW - 2) + [1.0, 0.3]  # a collector's pause, an evaluation
    assert pace_of(window) == 0.05  # (one in a hundred is an outlier)
    window[:3] = [0.15, 0.15, 0.15]  # a slower step every 66: it is the pace
    assert pace_of(window) == 0.15


def test_the_limit_is_paces_within_the_floor_and_the_hang_timeout() -> None:
    assert hang_limit(0.0, 30.0) == 30.0  # not known yet
    assert hang_limit(0.01, 30.0) == HANG_FLOOR_S
    assert hang_limit(0.2, 30.0) == pytest.approx(HANG_PACES * 0.2)
    assert hang_limit(10.0, 30.0) == 30.0
    assert hang_limit(0.2, 30.0, by_pace=False) == 30.0


def test_a_wait_on_a_named_peer_is_in_the_file_and_ends_with_the_wait(
    tmp_path: Path, clock: Clock
) -> None:
    path = str(tmp_path / "hb")
    hb = HeartbeatWriter(path)
    try:
        hb.beat()
        mine = clock.now
        clock.now += 2.0
        with hb.waiting_on(3, 2**61 + 5):  # a heal's other end (a 62-bit incarnation)
            b = read_heartbeat(path)
            assert b is not None and b.waits == Wait.PEER and b.waiting == clock.now
            assert (b.on_rank, b.on_incarnation) == (3.0, 2**61 + 5)
            assert b.main == clock.now  # (entering the wait is the main thread's beat)
        with hb.blocked:
            b = read_heartbeat(path)
            assert b is not None and b.waits == Wait.RUNTIME and b.on_rank == -1.0
        b = read_heartbeat(path)
        assert b is not None and b.waits == Wait.NONE and b.waiting == 0.0 and b.main > mine
    finally:
        hb.close()
