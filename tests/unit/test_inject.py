"""Fault plans and the injector's scheduling (executor faked: nothing is killed here)."""

from __future__ import annotations

import json
import time

import pytest

from fastft.errors import ConfigError
from fastft.inject import FaultKind, FaultPlan, FaultSpec, Injector
from fastft.protocol import Heartbeat, Inject


def test_plan_round_trips_through_json():
    plan = FaultPlan(
        (
            FaultSpec(FaultKind.SIGKILL, rank=1, at_step=40),
            FaultSpec("exception", rank=0, at_step=10, life=1, arg=3),
        )
    )
    assert FaultPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    "text, match",
    [
        ("not json", "not valid JSON"),
        ("[]", "faults"),
        ('{"faults": [{"kind": "meteor", "rank": 0}]}', "unknown fault kind 'meteor'"),
        ('{"faults": [{"kind": "sigkill"}]}', "needs 'kind' and 'rank'"),
        ('{"faults": [{"kind": "sigkill", "rank": -1}]}', "rank=-1"),
        ('{"faults": [{"kind": "sigkill", "rank": 0, "at_step": "soon"}]}', "at_step"),
        ('{"faults": [{"kind": "sigkill", "rank": 0, "when": 3}]}', "when"),
        ('{"faults": [{"kind": "exit", "rank": 0, "arg": NaN}]}', "finite number"),
        ('{"faults": [{"kind": "gil_hang", "rank": 0, "arg": Infinity}]}', "finite number"),
        ('{"faults": [{"kind": "exit", "rank": 0, "arg": 1e300}]}', "finite number"),
        ('{"faults": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested too deeply"),
    ],
)
def test_bad_plans_say_what_to_fix(text, match):
    with pytest.raises(ConfigError, match=match):
        FaultPlan.from_json(text)


def test_load_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        FaultPlan.load(tmp_path / "nope.json")
    (tmp_path / "latin1.json").write_bytes(b'{"faults": []} \xff\xfe')
    with pytest.raises(ConfigError, match="not UTF-8"):
        FaultPlan.load(tmp_path / "latin1.json")


def test_injector_fires_due_faults_once_and_only_in_their_life():
    plan = FaultPlan(
        (
            FaultSpec("exception", rank=0, at_step=3),
            FaultSpec("sigkill", rank=0, at_step=5, life=1),
            FaultSpec("sigkill", rank=1, at_step=2),
        )
    )
    fired = []
    inj = Injector(plan, rank=0, life=0, executor=fired.append)
    for step in range(10):
        inj.fire_due(step)
    assert [(f.kind, f.at_step) for f in fired] == [(FaultKind.EXCEPTION, 3)]
    again = Injector(plan, rank=0, life=1, executor=fired.append)
    for step in range(10):
        again.fire_due(step)
    assert fired[-1].kind is FaultKind.SIGKILL and len(fired) == 2


def test_live_injection_from_the_bus():
    fired = []
    inj = Injector(FaultPlan(), rank=2, executor=fired.append)
    msg = dict(job="j", epoch=0, rank=-1, incarnation=1)
    inj.on_message(Heartbeat(**msg))
    inj.on_message(Inject(**msg, target_rank=1, fault_kind="sigkill"))  # not for us
    inj.on_message(Inject(**msg, target_rank=2, fault_kind="sigstop"))  # process-level: now
    assert [f.kind for f in fired] == [FaultKind.SIGSTOP]
    inj.on_message(Inject(**msg, target_rank=2, fault_kind="exception"))  # main thread only
    inj.on_message(Inject(**msg, target_rank=2, fault_kind="exit", at_step=7, arg=3))
    inj.on_message(Inject(**msg, target_rank=2, fault_kind="bogus"))  # logged, ignored
    assert len(fired) == 1
    inj.fire_due(4)
    assert fired[-1].kind is FaultKind.EXCEPTION
    inj.fire_due(7)
    assert fired[-1].kind is FaultKind.EXIT and fired[-1].arg == 3.0
    assert json.loads(FaultPlan(tuple(fired)).to_json())["faults"][0]["kind"] == "sigstop"


def test_faults_at_the_commit_and_heal_points_fire_only_there():
    plan = FaultPlan.from_json(
        json.dumps(
            {
                "faults": [
                    {"kind": "sigkill", "rank": 0, "at_step": 3, "point": "commit"},
                    {"kind": "sigstop", "rank": 0, "at_step": 5, "point": "heal"},
                    {"kind": "exception", "rank": 0, "at_step": 4},
                ]
            }
        )
    )
    fired: list[tuple[str, str]] = []
    inj = Injector(plan, rank=0, executor=lambda s: fired.append((s.kind.value, s.point)))
    inj.fire_due(6)  # the start of a step fires only step-point faults
    assert fired == [("exception", "step")]
    inj.fire_due(2, point="commit")
    inj.fire_due(4, point="heal")
    assert len(fired) == 1
    inj.fire_due(3, point="commit")
    inj.fire_due(5, point="heal")
    assert fired[1:] == [("sigkill", "commit"), ("sigstop", "heal")]
    assert inj.pending == ()


@pytest.mark.parametrize(
    "item, match",
    [
        ({"kind": "sigkill", "rank": 0, "at_step": 1, "point": "later"}, "point='later'"),
        ({"kind": "sigkill", "rank": 0, "point": "heal"}, "needs an at_step"),
        ({"kind": "exception", "rank": 0, "at_step": 1, "point": "commit"}, "process faults"),
        ({"kind": "sigkill", "rank": 0, "at_step": 1, "delay_s": -1}, "delay_s=-1"),
        ({"kind": "sigkill", "rank": 0, "at_step": 1, "delay_s": "soon"}, "delay_s='soon'"),
    ],
)
def test_bad_fault_points_say_what_to_fix(item, match):
    with pytest.raises(ConfigError, match=match):
        FaultPlan.from_json(json.dumps({"faults": [item]}))


def test_a_delayed_fault_waits_at_its_point_then_fires():
    plan = FaultPlan.from_json(
        json.dumps(
            {
                "faults": [
                    {
                        "kind": "sigkill",
                        "rank": 0,
                        "at_step": 2,
                        "point": "collective",
                        "delay_s": 0.05,
                    }
                ]
            }
        )
    )
    assert plan.faults[0].delay_s == 0.05
    assert FaultPlan.from_json(plan.to_json()) == plan
    fired: list[float] = []
    inj = Injector(plan, rank=0, executor=lambda s: fired.append(time.monotonic()))
    t0 = time.monotonic()
    inj.fire_due(2, point="collective")
    assert len(fired) == 1 and fired[0] - t0 >= 0.05
