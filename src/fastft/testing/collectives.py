"""A counter of a process's allreduces, for tests that count a step's collectives (the
step's vote riding its gradients' allreduce: :mod:`fastft.runtime.state.inband`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["count_allreduces"]


def count_allreduces() -> list[int]:
    """Count every allreduce this process's process groups run from now on (fastft's
    epochs use Gloo's backend, a script's own groups the ProcessGroup): the returned
    list's one element is the count so far."""
    count = [0]
    kinds: tuple[Any, ...] = (dist.ProcessGroup, dist.ProcessGroupGloo)
    for kind in kinds:
        real = kind.allreduce

        def counted(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            count[0] += 1
            return _real(self, *args, **kwargs)

        kind.allreduce = counted
    return count
