"""Repeat offenders, failed health checks and the in-process restart's timeouts: the pure
parts (issue 23)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastft.errors import ConfigError
from fastft.launch.rules.offenders import Offenders, QuarantineRule
from fastft.launch.rules.policy import after_exit
from fastft.protocol import EXIT_DRAINED
from fastft.protocol.exits import EXIT_UNHEALTHY
from fastft.runtime.health import builtin_checks, first_failure
from fastft.runtime.restart import timeouts
from fastft.runtime.state.registry import StateRegistry

BASE = dict(
    rank=1,
    life=0,
    max_restarts=3,
    stopping=False,
    already_done=False,
    peers_finished=False,
    spares_left=False,
    elastic=False,
)


def test_the_quarantine_rule_parses_or_says_what_to_write():
    assert QuarantineRule.parse("3/600") == QuarantineRule(3, 600.0)
    assert QuarantineRule.parse("off") is None
    for bad in ("3", "0/60", "3/0", "x/y", "3/-1"):
        with pytest.raises(ConfigError, match="--quarantine"):
            QuarantineRule.parse(bad)


def test_a_slot_is_quarantined_at_the_nth_fault_within_the_window_once():
    o = Offenders(QuarantineRule(3, 10.0))
    assert o.fault(1, 0.0, "a") is None and o.fault(1, 5.0, "b") is None
    assert o.fault(1, 11.0, "c") is None  # the first fell out of the window
    why = o.fault(1, 12.0, "signal 9")
    assert why is not None and "rank 1 faulted 3 times within 10 s" in why and "signal 9" in why
    assert o.fault(1, 13.0, "d") is None and o.quarantined == {1: why}  # said once
    assert o.fault(2, 13.0, "e") is None  # per slot
    o.replaced(1)
    assert o.count(1) == 0 and not o.quarantined
    assert Offenders(None).fault(1, 0.0, "a") is None  # off


def test_an_unhealthy_or_quarantined_slot_goes_to_a_spare_or_shrinks_or_stops_the_job():
    for kw in ({"code": EXIT_UNHEALTHY}, {"code": EXIT_DRAINED, "quarantined": "rank 1 ..."}):
        spare = after_exit(sig=None, **{**BASE, "spares_left": True, **kw})
        assert spare.restart and spare.spare_only
        shrink = after_exit(sig=None, **{**BASE, "elastic": True, **kw})
        assert shrink.done and not shrink.restart and shrink.shrink and not shrink.failed
        stop = after_exit(sig=None, **{**BASE, **kw})
        assert stop.done and stop.failed and "no warm spare can take its place" in stop.failed
        spent = after_exit(sig=None, **{**BASE, "spares_left": True, "life": 3, **kw})
        assert spent.failed and "--max-restarts 3" in spent.failed
        late = after_exit(sig=None, **{**BASE, "peers_finished": True, **kw})
        assert late.done and not late.failed
    assert "health check" in (after_exit(code=EXIT_UNHEALTHY, sig=None, **BASE).failed or "")
    plain = after_exit(code=1, sig=None, **BASE)  # not quarantined: restarted in place
    assert plain.restart and not plain.spare_only


def test_a_health_check_fails_on_false_a_reason_or_an_exception():
    def boom() -> None:
        raise OSError("no device")

    assert first_failure([("a", lambda: None), ("b", lambda: True)]) is None
    assert str(first_failure([("a", lambda: False)])) == "a: returned False"
    assert str(first_failure([("a", lambda: None), ("b", lambda: "too hot")])) == "b: too hot"
    assert str(first_failure([("c", boom)])) == "c: raised OSError: no device"


def test_the_state_check_finds_nan_and_inf_in_parameters_and_optimizer_state():
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    reg = StateRegistry()
    reg.register(model, opt)
    checks = builtin_checks(reg, host_floor_mb=0, check_state=True)
    assert [n for n, _ in checks] == ["state"] and first_failure(checks) is None
    with torch.no_grad():
        opt.state[model.bias]["exp_avg"][0] = float("inf")
    failed = first_failure(checks)
    assert failed is not None and "optimizer state exp_avg" in failed.why
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    failed = first_failure(checks)
    assert failed is not None and failed.why == "parameter weight holds NaN or Inf"
    assert builtin_checks(reg, host_floor_mb=0, check_state=False) == []


def test_the_host_memory_floor():
    reg = StateRegistry()
    (check,) = builtin_checks(reg, host_floor_mb=1 << 40, check_state=False)
    assert check[0] == "host_memory" and "MiB of host memory available" in check[1]()
    (check,) = builtin_checks(reg, host_floor_mb=1, check_state=False)
    assert check[1]() is None


def test_timeouts_come_before_the_agents_kill():
    assert timeouts(30.0, None, None) == (15.0, 27.0)  # half, then 90 %: the agent's comes last
    assert timeouts(0.5, None, None) == (0.25, 0.45)  # a worker's pace: the same shares
    assert timeouts(30.0, 2.0, None) == (2.0, 27.0)
    assert timeouts(30.0, 5.0, 1.0) == (5.0, 5.0)  # never before the soft one
