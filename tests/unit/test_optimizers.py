"""Several optimizers registered as one (``fastft.Optimizers``, issue 61): torch's state
format over all of them, a state loaded into fresh optimizers trains on identically, the
schedulers still step their own, and what cannot work is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fastft import Optimizers
from fastft.runtime.state.registry import StateRegistry


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    g, d = nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    og = torch.optim.Adam(g.parameters(), lr=1e-2)
    od = torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)
    return g, d, og, od


def _train(g, d, opts, steps, scheds=()):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opts.zero_grad()
        d(g(x)).sum().backward()
        opts.step()
        for s in scheds:
            s.step()


def test_a_state_round_trips_and_fresh_optimizers_train_on_identically():
    g, d, og, od = _pair()
    scheds = [
        torch.optim.lr_scheduler.StepLR(og, 2),
        torch.optim.lr_scheduler.ExponentialLR(od, 0.5),
    ]
    both = Optimizers(og, od)
    _train(g, d, both, 3, scheds)
    state = copy.deepcopy(both.state_dict())
    assert [len(gr["params"]) for gr in state["param_groups"]] == [2, 4]
    assert state["param_groups"][1]["lr"] == pytest.approx(0.0125)
    g2, d2 = copy.deepcopy(g), copy.deepcopy(d)
    og2 = torch.optim.Adam(g2.parameters(), lr=1e-2)
    od2 = torch.optim.SGD(d2.parameters(), lr=0.1, momentum=0.9)
    again = Optimizers(og2, od2)
    again.load_state_dict(state)
    assert len(again.state) == 6 and og2.state_dict()["param_groups"][0]["params"] == [0, 1]
    assert (og2.param_groups[0]["lr"], od2.param_groups[0]["lr"]) == (
        og.param_groups[0]["lr"],
        0.0125,
    )
    _train(g, d, both, 1)
    _train(g2, d2, again, 1)
    for p, q in zip(
        [*g.parameters(), *d.parameters()], [*g2.parameters(), *d2.parameters()], strict=True
    ):
        assert torch.equal(p, q)


def test_a_list_registers_as_one_and_each_ones_scheduler_must_be_registered():
    g, d, og, od = _pair()
    sched = torch.optim.lr_scheduler.StepLR(od, 3)
    with pytest.raises(TypeError, match="StepLR steps a registered optimizer"):
        StateRegistry().register(model=nn.ModuleDict({"g": g, "d": d}), optimizer=[og, od])
    r = StateRegistry()
    r.register(model=nn.ModuleDict({"g": g, "d": d}), optimizer=[og, od], sched=sched)
    assert isinstance(r.optimizer, Optimizers) and r.optimizer.optimizers == [og, od]


def test_what_cannot_work_is_refused():
    g, d, og, od = _pair()
    with pytest.raises(TypeError, match="takes one or more"):
        Optimizers()
    with pytest.raises(TypeError, match="a parameter is in two"):
        Optimizers(og, torch.optim.SGD(g.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="not a group"):
        Optimizers(Optimizers(og), od)
