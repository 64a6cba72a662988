"""The main thread's queue as the core keeps it (pure): which actions it runs
(:data:`MAIN_ACTIONS`), when a queued one is stale (:func:`stale`), which transitions end
its waits (:func:`moved`), and when a worker's own failure is a consequence of a fault
already handled (:func:`superseded`)."""

from __future__ import annotations

from collections.abc import Sequence

from fastft.fsm import (
    Action,
    ApplyCommit,
    CastVote,
    ConfigureProcessGroup,
    ExitWorker,
    FetchState,
    FormEpoch,
    SendState,
    StepState,
    ZeroGrads,
)
from fastft.protocol import Severity

__all__ = ["EPOCH_ACTIONS", "HEALING_ACTIONS", "MAIN_ACTIONS", "moved", "stale", "superseded"]

MAIN_ACTIONS = (
    CastVote,
    ApplyCommit,
    ZeroGrads,
    ConfigureProcessGroup,
    FormEpoch,
    FetchState,
    SendState,
    ExitWorker,
)
"""Queued for the main thread (every other action runs on the thread that fed the event)."""
HEALING_ACTIONS = (FormEpoch, ConfigureProcessGroup, FetchState, SendState)
EPOCH_ACTIONS = (ZeroGrads, FormEpoch)
"""Actions of one epoch's rollback: stale in any later epoch."""


def stale(
    action: Action, queued_changes: int, queued_epoch: int, phase_changes: int, epoch: int
) -> str | None:
    """Why a main-thread ``action``, queued when the machine had made ``queued_changes``
    phase changes and was in ``queued_epoch``, must not run now (``phase_changes``,
    ``epoch``), or None to run it:

    * ``"healing"``: queued by a healing that a later fault ended (the new one queued its
      own);
    * ``"epoch"``: a rollback of an epoch this worker has left (a second notice of a death
      that the formation in progress had already excluded). Run, it left the new epoch in
      silence while its peers built their process group and waited for it until the
      group's 60 s timeout.
    """
    if isinstance(action, HEALING_ACTIONS) and queued_changes != phase_changes:
        return "healing"
    if isinstance(action, EPOCH_ACTIONS) and queued_epoch != epoch:
        return "epoch"
    return None


def moved(before: StepState, after: StepState, actions: Sequence[Action]) -> bool:
    """Whether a transition ends what the main thread waits on (its waits end when the
    count of such moves changes): the phase changed, or a whole rollback ran inside one
    transition and queued a new formation (a member left alone goes HEALING -> HEALING
    through both barriers: its process-group build for the dead peer waited 60 s; found
    by the simulator)."""
    return after.phase is not before.phase or any(isinstance(a, FormEpoch) for a in actions)


def superseded(gen: int | None, phase_changes: int, severity: Severity) -> bool:
    """Whether a worker's own transient failure of work begun at ``gen`` phase changes is a
    consequence of a fault already handled (the machine moved since: a peer's fault rolled
    the step back): it then starts nothing, since a second rollback cycle would wait for
    members already past it. A lost state (Fault1) is never superseded."""
    return gen is not None and gen != phase_changes and severity is Severity.FAULT2
