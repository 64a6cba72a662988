"""When a worker hands its committed state to the durable tier (``--checkpoint-dir``): after
a commit, if a checkpoint is due (every N steps or T seconds) or forced (a drain: the
leavers may take the last holders of the state with them), and once more at a clean end
if the last one was deferred. Only the epoch's first member writes: every member holds
the same state (S3). The executor's part for it, as
:class:`~fastft.runtime.engine.membership.Membership` is for formations; the writing itself is
:class:`~fastft.runtime.durable.checkpoints.Checkpoints`'."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from fastft.protocol.exits import CHECKPOINT_FAILURES
from fastft.runtime.durable.checkpoints import due
from fastft.runtime.endings import CheckpointsFail

if TYPE_CHECKING:
    from fastft.process.events import EventLog
    from fastft.runtime.contract import EpochView, Member, RuntimeConfig
    from fastft.runtime.durable.checkpoints import Checkpoints

__all__ = ["CommitCheckpoints"]

log = logging.getLogger(__name__)


class CommitCheckpoints:
    """The executor's checkpoints after commits (see the module). ``state(step)``: the
    registered state of committed ``step``, as the durable tier saves it."""

    def __init__(
        self,
        durable: Checkpoints | None,
        config: RuntimeConfig,
        events: EventLog,
        state: Callable[[int], dict[str, Any]],
        shield: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.shield = shield
        """Around a wait for the writer: the heartbeat goes on meanwhile (the agent must not
        take the wait for a hang)."""
        self.durable = durable
        self.config = config
        self.events = events
        self.state = state
        self.unsettled: tuple[int, bool] | None = None
        """A commit whose checkpoint waits for the script's post-commit code: (the
        committed count, forced)."""

    def committed(self, step: int, *, force: bool) -> None:
        """``step`` steps are committed; the state to save is the one after the script's
        post-commit code (a scheduler stepped under ``if tx.committed:``), so the
        checkpoint waits for :meth:`settle` (the next step's start, or the close)."""
        self.unsettled = (step, force)

    def settle(self, view: EpochView | None, me: Member) -> None:
        """Hand the last commit's state to the durable tier if a checkpoint is due."""
        pending, self.unsettled = self.unsettled, None
        if pending is not None:
            self.after_commit(pending[0], view, me, force=pending[1])

    def leaving(self, step: int, epoch: int) -> None:
        """A drainer leaves from a formation holding committed ``step`` while others hold
        it too: a holder it counted on can still die after it left (a chaos soak lost 27
        steps that way), so it writes what it holds first, whichever member it is, and
        waits for the write. Not while the last commit's post-commit code has not run (the
        registered state is not the one to save yet) or once ``step`` was written."""
        d = self.durable
        if d is None or self.unsettled is not None or d.last_step >= step:
            return
        if d.busy:
            self._wait(d, step, "a leaver's checkpoint waits for the write in progress")
        t0 = time.monotonic()
        if d.save_async(step, epoch, self.state(step)):
            ms = round((time.monotonic() - t0) * 1e3, 3)
            self.events.emit("checkpoint_staged", step=step, stage_ms=ms)
            self._wait(d, step, "a drainer leaving from a formation writes the state it holds")

    def covers(self, step: int, epoch: int) -> bool:
        """Whether committed ``step`` is in a complete checkpoint, written first by this
        worker (which holds it) if no member wrote it yet: the last holder of the state
        may then leave (a whole job preempted; nobody left to heal). False without the
        durable tier, before the step's post-commit code ran (the registered state is not
        the one to save yet), or when the write failed."""
        d = self.durable
        if d is None:
            return False
        if d.has(step):
            return True
        if self.unsettled is not None:
            return False
        self.leaving(step, epoch)
        return d.has(step)

    def last(self, step: int, view: EpochView | None, me: Member) -> None:
        """At a clean end: the last committed state, if a checkpoint of it was deferred."""
        d = self.durable
        if d is not None and d.deferred:
            self._wait(d, step, "the last commit's checkpoint was deferred behind it")
            self.after_commit(step, view, me)

    def _wait(self, d: Checkpoints, step: int, why: str) -> None:
        """Wait for the write in progress (at most the writer's bound), alive meanwhile."""
        t0 = time.monotonic()
        with self.shield():
            d.wait()
        ms = round((time.monotonic() - t0) * 1e3, 3)
        self.events.emit("checkpoint_wait", step=step, wait_ms=ms, why=why, done=not d.busy)

    def after_commit(
        self, step: int, view: EpochView | None, me: Member, force: bool = False
    ) -> None:
        """Hand the committed state of ``step`` to the durable tier if one is due (or
        ``force``: every member drains after it). Only ``view``'s first member writes."""
        d, cfg = self.durable, self.config
        if d is None or view is None or view.members[0] != me:
            return
        if len(d.failing) >= CHECKPOINT_FAILURES:
            why = (
                f"the last {len(d.failing)} checkpoints in --checkpoint-dir {d.root} failed "
                f"({'; '.join(d.failing[-CHECKPOINT_FAILURES:])}): the job stops rather than "
                "train on with nothing to restore; free space or fix the directory, then "
                "run again (it resumes from the newest checkpoint written)"
            )
            self.events.emit("checkpoints_fail", step=step, error=why)
            log.critical("%s", why)
            raise CheckpointsFail(why)
        d.prepare()  # the writer process, started before the first checkpoint is due
        if force and d.busy:  # (members leave after this one: it must be written)
            self._wait(d, step, "a drain's checkpoint must be written")
        if d.deferred and d.busy:
            return
        if (
            not force
            and not d.deferred
            and not due(
                step,
                last_step=d.last_step,
                last_time=d.last_time,
                now=time.monotonic(),
                every=cfg.checkpoint_every,
                interval_s=cfg.checkpoint_interval_s,
            )
        ):
            return
        t0 = time.monotonic()
        # the step loop pays for the copy into the writer's shared buffer only
        if d.save_async(step, view.epoch, self.state(step)):
            self.events.emit(
                "checkpoint_staged", step=step, stage_ms=round((time.monotonic() - t0) * 1e3, 3)
            )
