"""Kept gradients in an elastic world when a step reduces more than its gradient (a JAX
step's ``tx.pmean`` of the loss after the gradient's): the first weighed reduction of an
attempt is the gradient, kept and reused; a later one is a mean over the samples the
attempt computed, nothing kept (issue 52: the second reduction once crashed the step)."""

from __future__ import annotations

import torch

from fastft.runtime.contract import EpochView, Member
from fastft.runtime.state.kept import KeptGradients


def test_a_second_reduction_is_weighed_by_the_samples_computed_and_keeps_nothing():
    k = KeptGradients(True)
    k.begin_attempt()
    assert k.shard(None, 4, 12, 3, 1) == slice(4, 8)
    grad, loss = torch.full((5,), 3.0), torch.tensor([2.0])
    k.weigh(grad, 4)
    k.weigh(loss, 4)
    assert torch.equal(grad, torch.full((5,), 1.0)) and torch.equal(loss, torch.tensor([2 / 3]))
    assert k.of_step(4) == (4, 8, 12) and k.grad is not None and k.grad.shape == (5,)


def test_a_retry_adds_the_kept_gradient_to_the_first_reduction_only():
    k = KeptGradients(True)
    k.begin_attempt()
    k.shard(None, 4, 12, 3, 0)  # this member took [0, 4) and kept it
    k.weigh(torch.full((5,), 3.0), 4)
    # the world shrank to 2 in step 4: the retry's plan, members 0 and 2 (kept [8, 12))
    view = EpochView(
        epoch=2,
        members=(Member(0, 1), Member(2, 3)),
        step=4,
        needs_state=frozenset(),
        source=None,
        kept=((0, 0, 4, 12), (2, 8, 12, 12)),
    )
    k.begin_attempt()
    part = k.shard(view, 4, 12, 2, 0)
    fresh = part.stop - part.start
    grad, loss = torch.full((5,), 6.0), torch.tensor([1.0])
    k.weigh(grad, 4)
    k.weigh(loss, 4)
    assert torch.allclose(grad, torch.full((5,), 6.0 * fresh / 12 + 1.0))  # (kept part added)
    assert torch.allclose(loss, torch.tensor([1.0 * fresh / 4]))  # (4 samples computed now)
