"""The exit statuses a worker and its agent share, and those of the job itself. Pure: the
agent's policy reads them without loading the worker runtime (or torch).

A worker's status tells its agent what to do with the slot; the job's (``fastft run``'s)
tells a batch scheduler what happened: 0 finished, 1 failed (the last line says why),
2 bad configuration, :data:`JOB_PREEMPTED` stopped by a SIGTERM and resumable,
:data:`JOB_INTERRUPTED` stopped by Ctrl-C.
"""

from __future__ import annotations

__all__ = [
    "CHECKPOINT_FAILURES",
    "ENDS_THE_JOB",
    "EXIT_CHECKPOINTS_FAIL",
    "EXIT_DATA_DIVERGED",
    "EXIT_DRAINED",
    "EXIT_FAULT_STORM",
    "EXIT_GROUP_FAULT",
    "EXIT_REPLICAS_DIVERGED",
    "EXIT_SCRIPT_ERROR",
    "EXIT_STATE_LOST",
    "EXIT_UNHEALTHY",
    "FASTFT_STATUSES",
    "JOB_FAILED",
    "JOB_INTERRUPTED",
    "JOB_PREEMPTED",
    "ending_path",
]

EXIT_STATE_LOST = 86
"""A worker's exit status when the job cannot go on: every holder of the committed state
was lost and nothing can restore it. The agent fails the job instead of restarting."""

EXIT_GROUP_FAULT = 87
"""A member of a shard group raised inside its step and ended: the agent restarts its
group (:mod:`fastft.runtime.groups.hsdp`)."""

EXIT_DRAINED = 88
"""A worker's exit status after a drain: it committed its last step and every member
acknowledged that it leaves. Its exit is no fault (:func:`fastft.protocol.fault_of`)."""

EXIT_FAULT_STORM = 89
"""A worker's exit status when ``max_recoveries`` recoveries in a row ended without a
committed step: the job stops (the agent fails it) instead of looping."""

EXIT_UNHEALTHY = 90
"""A worker's exit status when it failed a health check before it joined or rejoined
(:mod:`fastft.runtime.health`): it is not admitted. The agent gives its slot to a warm
spare, or lets the world shrink (elastic), or stops the job with the reason."""

EXIT_DATA_DIVERGED = 91
"""A worker's exit status when the members of a step drew different batches from their
``fastft.Batches`` (the batch check before the vote): the step is not committed and the
job fails, since training on would silently use the wrong data."""

EXIT_CHECKPOINTS_FAIL = 92
"""A worker's exit status when :data:`CHECKPOINT_FAILURES` checkpoints in a row failed to
be written: the job fails rather than train on with no durable tier."""

EXIT_SCRIPT_ERROR = 93
"""A worker's exit status when its script uses fastft in a way that cannot work (a
collective on torch's default process group, which fastft does not create): its message
says what to change, and the job fails at once, since a restart would fail the same way."""

EXIT_REPLICAS_DIVERGED = 94
"""A worker's exit status when the in-band replica check found members of an epoch holding
different state at the start of a step (``--compare-every``): its message names the item
(parameters, buffers, optimizer, a registered object), the members and the likely cause;
the job fails rather than train on different replicas."""

CHECKPOINT_FAILURES = 3
"""Checkpoints that fail in a row before the job fails (``EXIT_CHECKPOINTS_FAIL``)."""

ENDS_THE_JOB = frozenset(
    {
        EXIT_STATE_LOST,
        EXIT_FAULT_STORM,
        EXIT_DATA_DIVERGED,
        EXIT_CHECKPOINTS_FAIL,
        EXIT_SCRIPT_ERROR,
        EXIT_REPLICAS_DIVERGED,
    }
)
"""A worker's statuses that say the job cannot go on: no restart can help, it fails."""

JOB_FAILED = 1
"""``fastft run``'s status when the job failed; its last line says why."""

JOB_PREEMPTED = 143
"""``fastft run``'s status after a SIGTERM (128 + SIGTERM, as a shell reports it): the
workers drained and the job stopped before its end; it is resumable (from the durable
tier's checkpoint, or from the start without one: the last line says which)."""

JOB_INTERRUPTED = 130
"""``fastft run``'s status after Ctrl-C (128 + SIGINT)."""

FASTFT_STATUSES = frozenset(range(EXIT_STATE_LOST, EXIT_REPLICAS_DIVERGED + 1))
"""The worker statuses that tell the agent something (86-94). A script can exit with any of
them for reasons of its own (``sys.exit(93)``), so each counts as fastft's only with the
worker's ending record beside it (:func:`ending_path`); without one it is that script's
own status: an ordinary failure of the worker."""


def ending_path(run_dir: str, rank: int, incarnation: int) -> str:
    """Where a worker life that ends with one of :data:`FASTFT_STATUSES` records the status
    and why, before it exits (read by its agent)."""
    return f"{run_dir}/.ending-{rank}-{incarnation}"
