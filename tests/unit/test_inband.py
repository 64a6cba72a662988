"""The step's vote carried in its gradients' allreduce (fastft.runtime.state.inband): the sums'
reading is the same on every member, and exact where it says so."""

from __future__ import annotations

import random

import torch

from fastft.runtime.state.inband import SLOTS, decode, encode, exact


def _sum(rows: list[list[float]], dtype: torch.dtype) -> list[float]:
    t = torch.tensor(rows, dtype=dtype).sum(0)  # (what an allreduce's SUM gives)
    return t.tolist()


def test_equal_digests_agree_and_a_flag_is_seen():
    d = random.Random(1).getrandbits(62)
    rows = [encode(False, False, d) for _ in range(5)]
    assert len(rows[0]) == SLOTS
    out = decode(_sum(rows, torch.float32), 5)
    assert out.same_batches and not out.flagged
    rows[3] = encode(True, False, d)  # one member drains
    assert decode(_sum(rows, torch.float32), 5).flagged
    rows[3] = encode(False, True, d)  # one saw a joiner
    assert decode(_sum(rows, torch.float32), 5).flagged


def test_any_difference_is_seen_whatever_the_others_hold():
    rng = random.Random(2)
    for _ in range(300):
        n = rng.randint(2, 9)
        base = rng.getrandbits(62)
        ds = [base] * n
        i = rng.randrange(n)
        ds[i] ^= 1 << rng.randrange(62)  # one bit of one member's digest
        # (mean-preserving differences too: a member below and one above the others)
        if n >= 3 and rng.random() < 0.5:
            j = (i + 1) % n
            ds[i], ds[j] = base - (1 << 8), base + (1 << 8)
        out = decode(_sum([encode(False, False, d) for d in ds], torch.float32), n)
        assert not out.same_batches, ds


def test_sums_are_exact_at_the_limit_and_the_limit_is_typed():
    n = 74_565
    assert exact(torch.float32, n) and not exact(torch.float32, n + 1)
    assert exact(torch.float64, 10**9)
    assert not exact(torch.bfloat16, 2) and not exact(torch.float16, 2)
    # the largest sums at the limit are integers float32 holds exactly
    top = torch.tensor([225.0] * n, dtype=torch.float32).sum()
    assert int(top) == 225 * n < 2**24
