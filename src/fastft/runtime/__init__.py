"""The worker side of fastft: ``init``, ``register``, the transactional step, epochs and
healing. See :mod:`fastft.runtime.worker`."""

from fastft.runtime.contract import EpochView, JobFinished, Member, RuntimeConfig, WorkerExit
from fastft.runtime.events import EventLog, read_events
from fastft.runtime.state import StateRegistry
from fastft.runtime.worker import Runtime, Transaction, init

__all__ = [
    "EpochView",
    "EventLog",
    "JobFinished",
    "Member",
    "Runtime",
    "RuntimeConfig",
    "StateRegistry",
    "Transaction",
    "WorkerExit",
    "init",
    "read_events",
]
