""":class:`NatsStore`: the NATS control plane's store as a ``torch.distributed.Store``, for
the workers and agents (the process groups' rendezvous goes through it). Its own module so
that :mod:`fastft.bus.nats` imports no torch: the operator's commands use ``NatsKV``."""

from __future__ import annotations

import torch.distributed as dist

from fastft.bus.nats import NatsKV

__all__ = ["NatsStore"]


class NatsStore(NatsKV, dist.Store):
    """``torch.distributed.Store`` over the job's JetStream key-value bucket."""

    _Timeout = dist.DistStoreError
