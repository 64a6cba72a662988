"""The state registry: gradient bucket views, rollback, serialization for healing."""

from __future__ import annotations

import torch
from torch import nn

from fastft.runtime.state import StateRegistry


def _setup() -> tuple[nn.Module, StateRegistry]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    r = StateRegistry()
    r.register(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    return m, r


def test_backward_accumulates_into_the_bucket_views():
    m, r = _setup()
    m(torch.ones(2, 4)).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    flat = r.grad_bucket()
    assert flat is not None and flat.numel() == sum(p.numel() for p in m.parameters())
    assert all(torch.equal(p.grad, w) for p, w in zip(m.parameters(), want, strict=True))
    r.zero_grads()
    assert not flat.any()
    m(torch.ones(2, 4)).sum().backward()
    assert r.grad_bucket() is flat, "the second backward wrote into the same bucket"
    assert all(torch.equal(p.grad, w) for p, w in zip(m.parameters(), want, strict=True))
    flat.mul_(2)  # what an allreduce does in place
    assert all(torch.equal(p.grad, 2 * w) for p, w in zip(m.parameters(), want, strict=True))


def test_a_replaced_grad_rebuilds_the_bucket_and_rollback_drops_it():
    m, r = _setup()
    m(torch.ones(2, 4)).sum().backward()
    flat = r.grad_bucket()
    first = next(m.parameters())
    first.grad = torch.ones_like(first)  # user code replaced a gradient
    again = r.grad_bucket()
    assert again is not flat and torch.equal(first.grad, torch.ones_like(first))
    r.rollback()  # an abandoned allreduce may still write into the old bucket
    assert all(p.grad is None for p in m.parameters())
    m(torch.ones(2, 4)).sum().backward()
    assert r.grad_bucket() is not again


def test_state_round_trips_for_healing():
    m, r = _setup()
    blob = r.serialize(7)
    d = r.digest(7)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1)
    assert r.digest(7) != d
    assert r.load(blob) == 7 and r.digest(7) == d
