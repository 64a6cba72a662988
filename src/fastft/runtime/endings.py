"""How a worker ends when it cannot go on, each a ``SystemExit`` with the exit status its
agent reads (:mod:`fastft.protocol.exits`): a training loop's ``except Exception`` lets it
end the worker. Named by what happened; each message says why and what to change."""

from __future__ import annotations

import traceback

from fastft.errors import FastFTError
from fastft.process.teardown import end_with
from fastft.protocol.exits import (
    EXIT_CHECKPOINTS_FAIL,
    EXIT_DATA_DIVERGED,
    EXIT_DRAINED,
    EXIT_FAULT_STORM,
    EXIT_REPLICAS_DIVERGED,
    EXIT_SCRIPT_ERROR,
    EXIT_STATE_LOST,
    EXIT_UNHEALTHY,
)

__all__ = [
    "ReplicaMismatch",
    "ReplicasDiverged",
    "CheckpointsFail",
    "DataDiverged",
    "Drained",
    "Ending",
    "FaultStorm",
    "JobFinished",
    "ScriptError",
    "StateLost",
    "Unhealthy",
    "WorkerExit",
    "misuse",
    "repeated",
    "signature",
]


class Ending(SystemExit):
    """A worker's end with its exit status (``status``) and why (``why``, printed after
    ``prefix``)."""

    status = 1
    prefix = ""

    def __init__(self, why: str) -> None:
        super().__init__(self.status)
        self.why = why
        end_with(self.status, str(self))  # (recorded; no interpreter teardown)

    def __str__(self) -> str:
        return f"{self.prefix}{self.why}"


class StateLost(Ending):
    """The job cannot go on (see :data:`EXIT_STATE_LOST`); its message says why and what
    to change. A SystemExit, so that a training loop's ``except Exception`` lets it end
    the worker, with its status."""

    status = EXIT_STATE_LOST


class Drained(Ending):
    """This worker drained: it committed its last step, every member let it go, and it
    ends with :data:`~fastft.protocol.EXIT_DRAINED` (the agent restarts it in a fixed
    world, as a new life that heals; not in an elastic one)."""

    status = EXIT_DRAINED
    prefix = "drained: "


class FaultStorm(Ending):
    """Too many recoveries without a commit (see :data:`EXIT_FAULT_STORM`)."""

    status = EXIT_FAULT_STORM


class CheckpointsFail(Ending):
    """Checkpoints keep failing to be written (see :data:`EXIT_CHECKPOINTS_FAIL`)."""

    status = EXIT_CHECKPOINTS_FAIL


class ScriptError(Ending):
    """The script uses fastft in a way that cannot work (see :data:`EXIT_SCRIPT_ERROR`)."""

    status = EXIT_SCRIPT_ERROR


_SCRIPTS_OWN = (ValueError, LookupError, ArithmeticError, AssertionError, NotImplementedError)
"""Errors that a step raising twice the same way (its attempt and the retry) raises
again in every retry and restart: the script's own, not a fault (:func:`repeated`)."""


def signature(e: BaseException) -> tuple[str, str, str] | None:
    """What makes two raises of ``e``'s kind the same: its type, message and the script's
    line that raised it; None for an error a retry may cure (a fault's, fastft's, torch's
    ``RuntimeError``)."""
    if not isinstance(e, _SCRIPTS_OWN) or isinstance(e, FastFTError):
        return None
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if "/fastft/" not in f.filename] or frames
    where = f"{mine[-1].filename}:{mine[-1].lineno} in {mine[-1].name}" if mine else "?"
    return type(e).__name__, str(e)[:300], where


def repeated(sig: tuple[str, str, str], step: int) -> str:
    """Why a step that raised the same error twice (``sig``) stops the job."""
    kind, message, where = sig
    return (
        f"step {step} raised {kind} at {where}: {message}, twice the same way (its attempt "
        "and the retry): the script's own error, not a fault; every retry and restart would "
        "raise it again, so the job stops at once"
    )


def misuse(e: BaseException) -> str | None:
    """What a script did wrong, if ``e`` says so, and how to fix it; None for any other
    error (a fault of the step, retried)."""
    if "Default process group has not been initialized" in str(e):
        return (
            "the script called a torch.distributed collective on the default process group "
            "(dist.all_reduce, dist.barrier, DDP, ...), which fastft does not create: its "
            "members change with every fault. In a step use tx.allreduce_gradients() or "
            "tx.allreduce([tensors]); for a reduction between steps (an evaluation), run it "
            "in a transaction of its own"
        )
    if isinstance(e, TypeError | AttributeError | NameError) and not isinstance(e, FastFTError):
        # a programming error: every retry and restart would raise it again
        frames = traceback.extract_tb(e.__traceback__)
        mine = [f for f in frames if "/fastft/" not in f.filename] or frames
        where = f" at {mine[-1].filename}:{mine[-1].lineno} in {mine[-1].name}" if mine else ""
        return (
            f"the step raised {type(e).__name__}{where}: {e} (a programming error in the "
            "script, not a fault: a retry would raise it again, so the job stops at once)"
        )
    return None


class DataDiverged(Ending):
    """The members of a step drew different batches (see :data:`EXIT_DATA_DIVERGED`)."""

    status = EXIT_DATA_DIVERGED


class ReplicasDiverged(Ending):
    """The members of an epoch hold different state (see :data:`EXIT_REPLICAS_DIVERGED`)."""

    status = EXIT_REPLICAS_DIVERGED


class ReplicaMismatch(FastFTError, RuntimeError):
    """The replicas differed with no majority to tell which is right: the step rolls back
    and runs again (a Fault2; :func:`fastft.runtime.state.compare.repair`)."""


class Unhealthy(Ending):
    """This worker failed a health check (see :data:`EXIT_UNHEALTHY`)."""

    status = EXIT_UNHEALTHY
    prefix = "health check failed: "


class WorkerExit(FastFTError, RuntimeError):
    """This worker must stop: it was excluded from the job, or the job is shutting down.
    Under ``fastft run`` the agent decides whether to restart it."""


class JobFinished(SystemExit):
    """Raised in a worker that was waiting for an epoch (to join, or to re-form after a
    peer's exit that turned out to be the end of the job) when the other members had
    finished the job (they closed after their last step): there is nothing left to train.
    A ``SystemExit`` with status 0, so an unhandled one ends the worker cleanly."""

    def __init__(self, step: int) -> None:
        super().__init__(0)
        self.step = step
        end_with(0)

    def __str__(self) -> str:
        return f"the job finished at step {self.step} while this worker was waiting for an epoch"
