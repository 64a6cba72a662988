"""The state registry: gradient bucket views, rollback, serialization for healing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastft.runtime.state.registry import StateRegistry


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


def test_a_replaced_grad_rebuilds_the_bucket_and_rollback_replaces_it():
    m, r = _setup()
    m(torch.ones(2, 4)).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    flat = r.grad_bucket()
    first = next(m.parameters())
    first.grad = torch.ones_like(first)  # user code replaced a gradient
    again = r.grad_bucket()
    assert again is not flat and torch.equal(first.grad, torch.ones_like(first))
    r.rollback()  # an abandoned allreduce may still write into the old bucket
    fresh = r.bucket.flat
    assert fresh is not None and fresh is not again and not fresh.any()
    assert all(p.grad.data_ptr() != again.data_ptr() for p in m.parameters())
    again.fill_(7.0)  # the abandoned allreduce writes late: the retry does not see it
    m(torch.ones(2, 4)).sum().backward()  # the retry accumulates into the new bucket
    assert r.grad_bucket() is fresh
    assert all(torch.equal(p.grad, w) for p, w in zip(m.parameters(), want, strict=True))


def test_the_buckets_vote_slots_follow_its_tail_and_survive_its_rebuild():
    """The in-band vote's slots (fastft.runtime.state.inband) end the bucket, after the tail of
    the buffers it carries: neither the gradients' views nor the tail move, what is
    weighed and averaged stops before them, and a rollback's rebuild keeps both sizes."""
    m, r = _setup()
    m(torch.ones(2, 4)).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    n = sum(p.numel() for p in m.parameters())
    buffers = [torch.full((3,), 2.0)]
    flat = r.grad_bucket(buffers, 5)
    assert flat is not None and flat.numel() == n + 3 + 1 + 5
    assert all(torch.equal(p.grad, w) for p, w in zip(m.parameters(), want, strict=True))
    tail, slots, reduced = r.bucket_tail, r.bucket.slots, r.bucket.reduced
    assert tail is not None and slots is not None and reduced is not None
    assert tail.numel() == 4 and tail.data_ptr() == flat[n:].data_ptr()
    assert slots.numel() == 5 and slots.data_ptr() == flat[n + 4 :].data_ptr()
    assert reduced.numel() == n + 4
    slots.fill_(9.0)
    reduced.div_(2)  # the average leaves the vote's sums alone
    assert torch.equal(slots, torch.full((5,), 9.0))
    assert r.grad_bucket(buffers, 5) is flat  # the same sizes: the same bucket
    r.rollback()
    fresh = r.bucket.flat
    assert fresh is not None and fresh is not flat and fresh.numel() == n + 4 + 5
    assert r.bucket.slots is not None and r.bucket.slots.numel() == 5


def test_packed_state_round_trips_for_healing():
    """The heal's wire form: a header and flat tensors, loaded by a fresh worker's registry
    (other parameters, no optimizer state yet), gives the same digest, optimizer state and
    other objects."""
    m, r = _setup()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    r.register(optimizer=opt, counter=_Counter(5))
    for _ in range(2):
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    header, flats = r.pack(9)
    assert len(header) < 4096 and all(f.dim() == 1 for f in flats)
    torch.manual_seed(1)  # other initial parameters than the sender's
    m2 = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    r2 = StateRegistry()
    r2.register(model=m2, optimizer=torch.optim.Adam(m2.parameters(), lr=0.1), counter=_Counter(0))
    got = StateRegistry.allocate(header)
    assert [(g.dtype, g.numel()) for g in got] == [(f.dtype, f.numel()) for f in flats]
    for g, f in zip(got, flats, strict=True):
        g.copy_(f)  # what the broadcast does
    assert r2.digest(9) != r.digest(9)
    assert r2.load_packed(header, got) == 9
    assert r2.digest(9) == r.digest(9)
    assert r2._others["counter"].n == 5
    for p2, p1 in zip(m2.parameters(), m.parameters(), strict=True):
        s1, s2 = opt.state[p1], r2.optimizer.state[p2]
        assert torch.equal(s1["exp_avg"], s2["exp_avg"]) and float(s1["step"]) == float(s2["step"])


class _Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, st: dict[str, int]) -> None:
        self.n = st["n"]


class _Mixed:
    """State of several dtypes and shapes, one of them empty, one not contiguous."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.t = {
            "ids": torch.randint(0, 1 << 40, (3, 5), generator=g),
            "mask": torch.rand(7, generator=g) > 0.5,
            "half": torch.rand(3, generator=g).half(),
            "empty": torch.zeros(0, 4),
            "double_t": torch.rand(4, 2, generator=g, dtype=torch.float64).t(),
            "byte": torch.tensor([1, 2, 3], dtype=torch.uint8),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.t)

    def load_state_dict(self, st: dict[str, torch.Tensor]) -> None:
        self.t = {k: v.clone() for k, v in st.items()}


def test_packed_state_of_mixed_dtypes_is_one_buffer_and_round_trips():
    m, r = _setup()
    r.register(optimizer=torch.optim.SGD(m.parameters(), lr=0.1), mixed=_Mixed(1))
    header, flats = r.pack(4)
    assert len(flats) == 1 and flats[0].dtype == torch.uint8  # one collective on CPU
    r2 = StateRegistry()
    torch.manual_seed(3)
    m2 = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    r2.register(model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1), mixed=_Mixed(2))
    (got,) = StateRegistry.allocate(header)
    got.copy_(flats[0])
    assert r2.load_packed(header, [got]) == 4
    assert r2.digest(4) == r.digest(4)
    for k, v in r._others["mixed"].t.items():
        w = r2._others["mixed"].t[k]
        assert w.dtype == v.dtype and w.shape == v.shape and torch.equal(w, v), k


class _Big(_Mixed):
    """A state with tensors over and under the direct-send size, one of them 0-dim."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.t = {
            "big": torch.rand(512, 1024, generator=g),  # 2 MiB
            "bool_big": torch.rand(2 << 20, generator=g) > 0.5,  # 2 MiB of bool
            "small": torch.rand(10, generator=g),
            "scalar": torch.tensor(float(seed)),
        }


def test_large_tensors_are_sent_as_they_are_without_a_copy():
    m, r = _setup()
    big = _Big(1)
    r.register(optimizer=torch.optim.SGD(m.parameters(), lr=0.1), big=big)
    header, wires = r.pack(6)
    assert len(wires) == 3  # the small tensors in one buffer, then the two large ones
    ptrs = {w.data_ptr() for w in wires}
    assert big.t["big"].data_ptr() in ptrs and big.t["bool_big"].data_ptr() in ptrs
    r2 = StateRegistry()
    torch.manual_seed(3)
    m2 = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    r2.register(model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1), big=_Big(2))
    got = StateRegistry.allocate(header)
    assert [(g.dtype, g.numel()) for g in got] == [(w.dtype, w.numel()) for w in wires]
    for g, w in zip(got, wires, strict=True):
        g.copy_(w)  # what the broadcast does
    assert r2.load_packed(header, got) == 6
    assert r2.digest(6) == r.digest(6)
    for k, v in big.t.items():
        w = r2._others["big"].t[k]
        assert w.dtype == v.dtype and w.shape == v.shape and torch.equal(w, v), k
    with pytest.raises(ValueError, match="wires"):
        r2.load_packed(header, got[:1])


def test_a_deferred_optimizer_state_goes_last_and_loads_apart():
    """``pack(defer=True)``: the optimizer's large tensors are the last wires (from
    ``tail``), the rest loads first (``part="head"``) without them, the step's snapshot
    survives loading the tail inside a step, and head + tail equal a whole load."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))  # a 1 MiB weight
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    r = StateRegistry()
    r.register(model=m, optimizer=opt, big=_Big(1))
    m(torch.ones(2, 512)).sum().backward()
    opt.step()
    header, wires = r.pack(3, defer=True)
    tail = StateRegistry.tail(header)
    moments = {opt.state[m[0].weight][k].data_ptr() for k in ("exp_avg", "exp_avg_sq")}
    # the small buffer, then the weight and _Big's two large tensors, then the moments
    assert tail == 4 and len(wires) == 6
    assert {w.data_ptr() for w in wires[tail:]} == moments
    plain_header, plain = r.pack(3)
    assert StateRegistry.tail(plain_header) == len(plain)
    assert sorted(w.numel() for w in plain) == sorted(w.numel() for w in wires)

    torch.manual_seed(5)
    m2 = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    r2 = StateRegistry()
    r2.register(model=m2, optimizer=opt2, big=_Big(2))
    got = StateRegistry.allocate(header)
    for g, w in zip(got[:tail], wires[:tail], strict=True):
        g.copy_(w)  # the tail's wires are still in transit
    assert r2.load_packed(header, got, part="head") == 3
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    assert torch.equal(r2._others["big"].t["big"], r._others["big"].t["big"])
    assert not opt2.state  # untouched: its wires may not have landed
    r2.begin_step()
    snap = r2._step_snapshot
    for g, w in zip(got[tail:], wires[tail:], strict=True):
        g.copy_(w)
    assert r2.load_packed(header, got, part="tail") == 3
    assert r2._step_snapshot is snap  # loaded inside the step: its snapshot stays
    assert r2.digest(3) == r.digest(3)
    with pytest.raises(ValueError, match="part"):
        r2.load_packed(header, got, part="optimizer")


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, st):
        self.n = st["n"]


def test_a_rollback_after_a_commit_keeps_what_the_committed_step_did():
    """A fault between a commit and the next step's start (the survivors of a death after
    the decision) rolls back nothing the committed step did."""
    r = StateRegistry()
    c = _Count()
    r.register(None, None, counter=c)
    r.begin_step()
    c.n += 1
    r.rollback()  # the step failed: undone
    assert c.n == 0
    r.begin_step()
    c.n += 1
    r.committed()
    r.rollback()  # after the commit: the step stays done
    assert c.n == 1
