"""The worker side of fastft: ``init``, ``register``, the transactional step, epochs and
healing. See :mod:`fastft.runtime.api` and, for what is where, ``docs/architecture.md``."""

from fastft.process.events import EventLog, read_events
from fastft.runtime.api import Runtime, Transaction, init
from fastft.runtime.contract import EpochView, JobFinished, Member, RuntimeConfig, WorkerExit
from fastft.runtime.state import StateRegistry

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
