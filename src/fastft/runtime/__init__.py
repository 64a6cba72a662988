"""The worker side of fastft: ``init``, ``register``, the transactional step, epochs and
healing. See :mod:`fastft.runtime.api` and, for what is where, ``docs/architecture.md``.

Its names are imported on first use: importing a pure module of the package
(``fastft.runtime.contract``, ``fastft.runtime.checks``) does not import torch (the agent
checks ``fastft run``'s flags with them: 3-4 s of torch import before a flag error)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastft.process.events import EventLog, read_events
    from fastft.runtime.api import Runtime, Transaction, init
    from fastft.runtime.contract import EXIT_STATE_LOST, EpochView, Member, RuntimeConfig
    from fastft.runtime.endings import JobFinished, StateLost, WorkerExit
    from fastft.runtime.state.data import Batches
    from fastft.runtime.state.optimizers import Optimizers
    from fastft.runtime.state.registry import StateRegistry

_WHERE = {
    "EXIT_STATE_LOST": "fastft.runtime.contract",
    "Batches": "fastft.runtime.state.data",
    "EpochView": "fastft.runtime.contract",
    "EventLog": "fastft.process.events",
    "JobFinished": "fastft.runtime.endings",
    "Member": "fastft.runtime.contract",
    "Optimizers": "fastft.runtime.state.optimizers",
    "Runtime": "fastft.runtime.api",
    "RuntimeConfig": "fastft.runtime.contract",
    "StateLost": "fastft.runtime.endings",
    "StateRegistry": "fastft.runtime.state.registry",
    "Transaction": "fastft.runtime.api",
    "WorkerExit": "fastft.runtime.endings",
    "init": "fastft.runtime.api",
    "read_events": "fastft.process.events",
}

__all__ = [
    "EXIT_STATE_LOST",
    "Batches",
    "EpochView",
    "EventLog",
    "JobFinished",
    "Member",
    "Optimizers",
    "Runtime",
    "RuntimeConfig",
    "StateLost",
    "StateRegistry",
    "Transaction",
    "WorkerExit",
    "init",
    "read_events",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'fastft.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
