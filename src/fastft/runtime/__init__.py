"""The worker side of fastft: ``init``, ``register``, the transactional step, epochs and
healing. See :mod:`fastft.runtime.api` and, for what is where, ``docs/architecture.md``."""

from fastft.process.events import EventLog, read_events
from fastft.runtime.api import Runtime, Transaction, init
from fastft.runtime.contract import EXIT_STATE_LOST, EpochView, Member, RuntimeConfig
from fastft.runtime.endings import JobFinished, StateLost, WorkerExit
from fastft.runtime.state.data import Batches
from fastft.runtime.state.registry import StateRegistry

__all__ = [
    "EXIT_STATE_LOST",
    "Batches",
    "EpochView",
    "EventLog",
    "JobFinished",
    "Member",
    "Runtime",
    "RuntimeConfig",
    "StateLost",
    "StateRegistry",
    "Transaction",
    "WorkerExit",
    "init",
    "read_events",
]
