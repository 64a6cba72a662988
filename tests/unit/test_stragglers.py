"""Stragglers (issue 50): who is named slow, once per life, and what its drain leads to;
the ``slow`` fault that makes one."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from fastft.errors import ConfigError
from fastft.inject import FaultPlan, FaultSpec, Injector
from fastft.launch.gray.stragglers import MIN_EXTRA_S, StragglerWatch, slow_members
from fastft.launch.rules.ledger import Ledger
from fastft.launch.rules.policy import after_exit
from fastft.protocol.exits import EXIT_DRAINED


def test_a_member_slower_than_the_median_of_the_others_is_named():
    computes = {0: (10, 0.060), 1: (11, 0.090), 2: (12, 0.058), 3: (13, 0.062)}
    (slow,) = slow_members(computes, 1.3)
    assert (slow.rank, slow.incarnation) == (1, 11)
    assert slow.others_s == pytest.approx(0.060) and slow.ratio == pytest.approx(1.5)
    assert slow_members(computes, 1.6) == []
    # two members: each against the other; only the slower one is named
    assert [s.rank for s in slow_members({0: (1, 0.05), 1: (2, 0.1)}, 1.3)] == [1]


def test_nothing_is_named_from_unknown_or_tiny_computes():
    assert slow_members({0: (1, 0.05)}, 1.3) == []  # alone
    assert slow_members({0: (1, 0.05), 1: (2, 0.0)}, 1.3) == []  # not known yet
    tiny = {0: (1, 0.001), 1: (2, 0.001 + MIN_EXTRA_S / 2), 2: (3, 0.001)}
    assert slow_members(tiny, 1.3) == []  # 3.5x of nothing is noise


def test_figures_are_compared_only_within_the_newest_epoch():
    """Issue 60, case 2: node 1 is cut off; the survivor computes its share too (2x) and
    was named slow against the figure node 1 wrote before the cut (and drained: the last
    holder of the state)."""
    computes = {0: (10, 0.100), 1: (11, 0.050)}
    assert [s.rank for s in slow_members(computes, 1.3)] == [0]  # (no epochs: as before)
    assert slow_members(computes, 1.3, {0: 5, 1: 4}) == []  # rank 1's figure is stale
    three = {0: (10, 0.100), 1: (11, 0.050), 2: (12, 0.050)}
    slow = slow_members(three, 1.3, {0: 5, 1: 5, 2: 4})
    assert [s.rank for s in slow] == [0]  # ranks 0 and 1 of epoch 5: rank 0 is slow
    assert slow_members(three, 1.3, {0: 5, 1: 4, 2: 4}) == []  # alone in the newest


def test_a_new_epoch_starts_the_figures_again(tmp_path):
    from fastft.process.beat import RECENT_STEPS, read_heartbeat
    from fastft.process.heartbeat import HeartbeatWriter

    hb = HeartbeatWriter(str(tmp_path / "hb"))
    try:
        for _ in range(RECENT_STEPS + 2):
            hb.between(False)
            hb.beat()
            hb.committed(clean=True)
        assert hb.compute > 0 and read_heartbeat(str(tmp_path / "hb")).epoch == 0.0
        pace = hb.pace
        hb.new_world(3)
        b = read_heartbeat(str(tmp_path / "hb"))
        assert b is not None and b.epoch == 3.0 and b.compute == 0.0 and b.step == 0.0
        assert hb.pace == pace  # (a hang is still judged by the pace)
    finally:
        hb.close()


def test_each_life_is_named_once():
    w = StragglerWatch()
    slow = slow_members({0: (1, 0.05), 1: (2, 0.1), 2: (3, 0.05)}, 1.3)
    assert [s.rank for s in w.newly(slow)] == [1]
    assert w.newly(slow) == []
    again = slow_members({0: (1, 0.05), 1: (4, 0.1), 2: (3, 0.05)}, 1.3)  # its next life
    assert [s.incarnation for s in w.newly(again)] == [4]


def test_a_replaced_straggler_starts_again_in_an_elastic_world_too():
    base = dict(rank=1, sig=None, life=0, max_restarts=3, stopping=False, already_done=False,
                peers_finished=False, spares_left=True)  # fmt: skip
    assert after_exit(code=EXIT_DRAINED, elastic=True, **base).done  # a drain: for good
    assert after_exit(code=EXIT_DRAINED, elastic=True, replaced=True, **base).restart
    assert after_exit(code=EXIT_DRAINED, elastic=False, replaced=True, **base).restart
    ledger = Ledger([1])
    ledger.replace(7)
    assert ledger.replaced(7) and not ledger.replaced(8)


def test_the_slow_fault_needs_a_factor_and_fires_at_a_step():
    with pytest.raises(ConfigError, match="factor its steps are slowed by"):
        FaultSpec(kind="slow", rank=0, at_step=3, arg=1.0)
    with pytest.raises(ConfigError, match="only process faults"):
        FaultSpec(kind="slow", rank=0, at_step=3, arg=2, point="commit")
    with pytest.raises(ConfigError, match="steps"):
        FaultSpec(kind="slow", rank=0, at_step=3, arg=2, steps=-1)
    assert FaultSpec(kind="slow", rank=0, at_step=3, arg=2, steps=4).severity == 0


def test_a_slow_fault_stretches_each_steps_compute_for_its_steps(monkeypatch):
    slept: list[float] = []
    clock = iter(float(t) for t in range(1000))
    fake = SimpleNamespace(sleep=slept.append, monotonic=lambda: next(clock))
    monkeypatch.setattr(sys.modules["fastft.inject.execute"], "time", fake)
    spec = FaultSpec(kind="slow", rank=0, at_step=3, arg=1.5, steps=2)
    inj = Injector(FaultPlan((spec,)), 0)
    for step in range(2, 7):
        inj.fire_due(step)  # the step begins (t), ...
        inj.fire_due(step, point="collective")  # ... its compute reaches the collective (t + 1)
    assert slept == [0.5, 0.5]  # steps 3 and 4: half their compute again
    assert [s.kind.value for s, _ in inj.fired] == ["slow"]
