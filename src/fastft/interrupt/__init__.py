"""Interrupting a blocked rank: signal, future exception, abort hooks, atomic sections."""

from fastft.interrupt.collectives import (
    allreduce,
    barrier,
    broadcast,
    broadcast_bytes,
    start_broadcast,
    wait_work,
)
from fastft.interrupt.contract import CollectiveFailed, FutureCancelled, StepInterrupted
from fastft.interrupt.interrupter import DEFAULT_SIGNAL, Interrupter

__all__ = [
    "DEFAULT_SIGNAL",
    "CollectiveFailed",
    "FutureCancelled",
    "Interrupter",
    "StepInterrupted",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_bytes",
    "start_broadcast",
    "wait_work",
]
