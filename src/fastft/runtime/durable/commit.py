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
from typing import TYPE_CHECKING

from fastft.protocol.exits import CHECKPOINT_FAILURES
from fastft.runtime.contract import CheckpointsFail
from fastft.runtime.durable.checkpoints import due

if TYPE_CHECKING:
    from fastft.runtime.engine.executor import Executor

__all__ = ["CommitCheckpoints"]

log = logging.getLogger(__name__)


class CommitCheckpoints:
    """The executor's checkpoints after commits (see the module)."""

    def __init__(self, x: Executor) -> None:
        self.x = x

    def last(self) -> None:
        """At a clean end: the last committed state, if a checkpoint of it was deferred."""
        d = self.x.durable
        if d is not None and d.deferred:
            d.wait()  # the write that deferred it
            self.after_commit(self.x.state.step)

    def after_commit(self, step: int, force: bool = False) -> None:
        """Hand the committed state of ``step`` to the durable tier if one is due (or
        ``force``: every member drains after it)."""
        x = self.x
        d, view, cfg = x.durable, x.view, x.config
        if d is None or view is None or view.members[0] != x.me:
            return
        if len(d.failing) >= CHECKPOINT_FAILURES:
            why = (
                f"the last {len(d.failing)} checkpoints in --checkpoint-dir {d.root} failed "
                f"({'; '.join(d.failing[-CHECKPOINT_FAILURES:])}): the job stops rather than "
                "train on with nothing to restore; free space or fix the directory, then "
                "run again (it resumes from the newest checkpoint written)"
            )
            x.events.emit("checkpoints_fail", step=step, error=why)
            log.critical("%s", why)
            raise CheckpointsFail(why)
        d.prepare()  # the writer process, started before the first checkpoint is due
        if force and d.busy:
            d.wait()  # (the job ends after this one: it must be written)
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
        if d.save_async(step, view.epoch, x.registry.state(step)):
            x.events.emit(
                "checkpoint_staged", step=step, stage_ms=round((time.monotonic() - t0) * 1e3, 3)
            )
