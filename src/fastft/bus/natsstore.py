""":class:`NatsStore`: the NATS control plane's store as a ``torch.distributed.Store``, for
the workers and agents (the process groups' rendezvous goes through it). Its own module so
that :mod:`fastft.bus.nats` imports no torch: the operator's commands use ``NatsKV``."""

from __future__ import annotations

import torch.distributed as dist

from fastft.bus.nats import NatsKV, nats_connection

__all__ = ["NatsStore", "connect_nats"]


def connect_nats(address: str, timeout_s: float = 30.0, wait_s: float = 0.0) -> NatsStore:
    """The job's store on the NATS cluster at ``address`` (comma-separated URLs) as a
    ``torch.distributed.Store``. Raises StoreUnreachable with one line if no server
    answers (within ``wait_s``) or JetStream is off."""
    return NatsStore(nats_connection(address, timeout_s, wait_s), timeout_s)


class NatsStore(NatsKV, dist.Store):
    """``torch.distributed.Store`` over the job's JetStream key-value bucket."""

    _Timeout = dist.DistStoreError
