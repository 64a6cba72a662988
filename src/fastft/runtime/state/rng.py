"""Random generators as a function of the step: every step attempt draws from generators
seeded from (job seed, step, rank), so a retried step draws the same numbers as its first
attempt and a restarted worker what it would have drawn (no RNG state is transferred)."""

from __future__ import annotations

import random

import torch

__all__ = ["reseed"]


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every global RNG from (seed, step, rank): deterministic per step attempt."""
    s = (seed * 1_000_003 + step) * 1_000_033 + rank
    s &= 2**63 - 1
    random.seed(s)
    # torch.manual_seed also visits every accelerator backend (~0.1 ms per call on CPU);
    # the CPU generator and, once CUDA is in use, the CUDA ones are all a step needs.
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():  # pragma: no cover - GPU machines only
        torch.cuda.manual_seed_all(s)
    try:
        import numpy as np

        np.random.seed(s & (2**32 - 1))
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
