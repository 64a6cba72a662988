"""Votes and epochs on the main thread: the executor's store-facing actions (join, form
the next epoch, adopt it, vote and wait for the decision). The decisions themselves are
the state machine's and :mod:`fastft.runtime.engine.formation`'s; this module performs them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from fastft.fsm import CastVote, FormEpoch, Phase
from fastft.protocol import JoinRequest
from fastft.runtime.contract import EpochView
from fastft.runtime.durable.checkpoints import CheckpointError
from fastft.runtime.endings import JobFinished, StateLost, WorkerExit
from fastft.runtime.engine import plans
from fastft.runtime.engine.formation import SurvivorWait
from fastft.runtime.engine.joiners import Joiners
from fastft.runtime.engine.sideclient import KeyCollector
from fastft.runtime.engine.survivors import Survivors
from fastft.runtime.groups.hsdp import heal_group, shard_source

if TYPE_CHECKING:
    from fastft.runtime.engine.ports import Engine

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, x: Engine) -> None:
        self.x = x
        self.survivors = Survivors(x.coord)
        self.joiners = Joiners(x.coord)
        self.collector = KeyCollector(x.side)
        self._decision_wait_ms: float | None = None
        self._below: tuple[int, int, int] | None = None
        self._confirmed: tuple[int, int] | None = None
        """The first member: the last step whose commit it confirmed, its key deleted at the
        next vote (every member has read it by then: they all entered the next step)."""

    def _below_min(self, have: int, need: int) -> None:
        """Said once per formation and count: an elastic world waits for restarted workers
        because fewer than ``--min-replicas`` are left."""
        key = (self.x.state.epoch, have, need)
        if self._below == key:
            return
        self._below = key
        self.x.events.emit("below_min_replicas", epoch=key[0] + 1, members=have, needed=need)
        log.warning(
            "%d of the %d members --min-replicas needs: waiting for restarted workers",
            have,
            need,
        )

    def applied(self, step: int) -> None:
        """``step`` is committed here: the first member records it, off the step's path
        (a total loss says what was lost: the last step applied, exactly, unless that
        member died within the write's round trip)."""
        if plans.records(self.x.view, self.x.me.rank):
            self.collector.record(step)

    def take_decision_wait(self) -> float | None:
        """The last fault-free commit's wait for its decision (logged with the commit)."""
        ms, self._decision_wait_ms = self._decision_wait_ms, None
        return ms

    # --- votes -----------------------------------------------------------------------------
    def vote(self, a: CastVote) -> None:
        x = self.x
        view = x.view
        assert view is not None
        t0 = time.monotonic()
        if self._confirmed is not None:
            self.collector.put(*self._confirmed)
            self._confirmed = None
        known = plans.voted(a)
        if known is not None:  # decided by the step's collective: no store request
            self._decision_wait_ms = 0.0
            x.feed(known)
            return
        if plans.confirms(a):  # (a late collective's commit, GradsReady.confirm)
            confirmed = x.coord.confirm(a.epoch, a.step)
            x.events.emit("vote_confirmed", epoch=a.epoch, step=a.step, decision=confirmed[:1])
            got: str | None = confirmed
            if plans.records(view, x.me.rank):  # (the first member deletes it, as a vote's)
                self._confirmed = (a.epoch, a.step)
        else:
            joiners = x.coord.joiners() if plans.needs_joiners(a, x.dp.k) else None
            got = x.coord.vote(
                a.epoch,
                a.step,
                len(view.members),
                leaving=a.want_drain,
                joining=plans.vote_joining(a, x.dp.k, joiners),
                ranks=tuple(sorted(view.ranks)),
            )
        while got is None:
            got = x.coord.await_decision(a.epoch, a.step)
            if x.closing:
                break
            x.sv.heartbeat.beat()
        do = plans.decided(view, x.me.rank, a.step, got if got is not None else "")
        if do.forget is not None:
            self.collector.put(a.epoch, do.forget)
        wait_ms = round((time.monotonic() - t0) * 1e3, 3)
        d = do.decision
        if do.quiet:  # the fault-free path: the commit's line
            self._decision_wait_ms = wait_ms
        else:
            x.events.emit(
                "decision",
                epoch=a.epoch,
                step=a.step,
                decision="commit" if d.commit else "rollback",
                reason=None if d.commit or got is None else got[1:],
                admit=d.admit,
                leaving=sorted(d.leaving),
                wait_ms=wait_ms,
            )
        x.feed(d)

    # --- epochs ----------------------------------------------------------------------------
    def _announce_join(self) -> None:
        x = self.x
        x.sv.bus.broadcast(
            JoinRequest(job=x.config.job, epoch=0, rank=x.me.rank, incarnation=x.me.incarnation)
        )

    def finished_meanwhile(self) -> NoReturn:
        """The other members finished the job while this one re-formed: it ends (0)."""
        step = self.x.coord.finished_at()
        e = JobFinished(step if step is not None else self.x.state.step)
        self._finished(e, f"the job finished at step {e.step} while this worker re-formed")
        raise e

    def _finished(self, e: JobFinished, what: str) -> None:
        self.x.events.emit("job_finished", step=e.step)
        log.warning("%s", what)

    def join(self) -> None:
        x = self.x
        x.events.emit("join_wait", incarnation=x.me.incarnation)
        t0 = time.monotonic()
        base = x.cancelled(Phase.INIT)

        def cancelled() -> bool:
            return base() or plans.joiner_leaves(x.state)

        wait = self.joiners.register(x.config.start_timeout_s, x.config.regroup_timeout_s)
        view = None
        for r in () if cancelled() else self.joiners.rounds(wait):
            if r.announce:
                self._announce_join()
            if r.finished is not None:
                e = JobFinished(r.finished)
                self._finished(e, str(e))
                raise e
            if r.view is not None or cancelled():
                view = r.view
                break
        if view is not None:
            self.adopt(view, waited_s=time.monotonic() - t0)
        elif plans.joiner_leaves(x.state):
            x.events.emit("drain_from_join")
            raise WorkerExit("asked while it waited to join")

    def form(self, a: FormEpoch) -> None:
        x = self.x
        prev = x.view
        assert prev is not None
        t0 = time.monotonic()
        v = x.registry.verified
        plan = plans.form(
            a,
            prev,
            x.me,
            x.dead,
            x.state,
            suspect=x.suspect_state,
            elastic=x.config.elastic,
            verified=v.step,
            wanted=v.wanted,
        )
        base = x.cancelled(Phase.HEALING)

        def cancelled() -> bool:
            return base() or self._drain(prev, plan).leaves

        self._drain_from_formation(prev, plan)
        wait = self.survivors.arrive(
            prev,
            plan.exclude,
            step=x.state.step,
            lost_state=a.lost_state,
            timeout_s=x.config.rollback_timeout_s,
            kept=x.kept.of_step(x.state.step),
            admit=plan.admit,
            suspect=x.suspect_state,
            rewind=plan.rewind,
        )
        x.sv.injector.fire_due(x.state.step, point="formation")  # (tests: a death now)
        view = None if cancelled() else self._rounds(wait, cancelled)
        if view is None:
            self._drain_from_formation(prev, plan)
            return
        x.suspect(False)  # (healed in this epoch, or the source: every state equal)
        out = plans.outsider(view, x.me)
        if out is not None:
            x.events.emit("excluded", epoch=view.epoch)
            x.feed(out)
            return
        self.adopt(view, waited_s=time.monotonic() - t0)

    def _rounds(self, wait: SurvivorWait, cancelled: Callable[[], bool]) -> EpochView | None:
        """Carry out the survivor's rounds (:class:`~.survivors.Round`) until the epoch
        closes (its view) or the formation is cancelled (None)."""
        x = self.x
        for r in self.survivors.rounds(wait):
            if r.silent:
                x.declare_silent(r.silent)
            if r.remind:
                x.remind()
            if r.below is not None:
                self._below_min(*r.below)
            if r.finished is not None:
                e = JobFinished(r.finished)
                self._finished(e, f"the job finished at step {e.step} while this worker re-formed")
                raise e
            if r.view is not None:
                return r.view
            if cancelled():
                return None
        return None

    def _drain(self, prev: EpochView, plan: plans.Form) -> plans.Drain:
        x = self.x
        return plans.drain(prev, plan.exclude, x.me, x.dead, x.state, plan.holds)

    def _drain_from_formation(self, prev: EpochView, plan: plans.Form) -> None:
        """A worker asked to drain while its epoch re-forms (:func:`.plans.drain`): it
        leaves at once if another live member holds the committed state, with
        ``--checkpoint-dir`` writing it first if it holds it; the last holder leaves too
        when nobody is to be healed and a checkpoint holds its state (written now if need
        be: :func:`.plans.holder_leaves`); else it stays, heals the others and leaves at
        its next commit."""
        x = self.x
        s = x.state
        do = self._drain(prev, plan)
        if do.leaves:
            if do is plans.Drain.LEAVE_WRITING:
                x.checkpoints.leaving(s.step, s.epoch)
            x.events.emit("drain_from_formation", step=s.step)
            raise WorkerExit("left while its epoch re-formed, another member holding the state")
        if do is plans.Drain.NONE:
            return
        if (
            do is plans.Drain.LAST
            and plans.holder_leaves(bool(x.coord.joiners()))
            and x.checkpoints.covers(s.step, s.epoch)
        ):
            x.events.emit("drain_from_formation", step=s.step, covered="checkpoint")
            raise WorkerExit(
                f"left while its epoch re-formed, the state it held in the checkpoint of "
                f"step {s.step}"
            )
        x.events.emit("drain_held", step=s.step, reason="the last holder of the state")

    def adopt(self, view: EpochView, waited_s: float) -> None:
        x = self.x
        x.events.emit(
            "epoch",
            epoch=view.epoch,
            members=[m.rank for m in view.members],
            incarnations=[m.incarnation for m in view.members],
            step=view.step,
            needs_state=sorted(view.needs_state),
            source=view.source,
            form_ms=round(waited_s * 1e3, 3),
            **({"kept": [list(k) for k in view.kept]} if view.kept else {}),
            **({"waiting": list(view.waiting)} if view.waiting else {}),
            **({"restore": view.restore} if view.restore is not None else {}),
            **({"lost": view.lost} if view.lost is not None else {}),
        )
        self._recover(view)
        x.sv.heartbeat.new_world(view.epoch)  # (its figures start again: a new share)
        x.adopt(view, self._source(view) if x.dp.heal_apart() else None)

    def _source(self, view: EpochView) -> int | None:
        """Who sends this member's state (its shard's, with shard groups). A member of an
        index that heals nobody is a bystander: any rank but its own says so."""
        me, k = self.x.me.rank, self.x.dp.k
        src = shard_source(view, me, k)
        if k > 1 and me not in view.needs_state and heal_group(view, me, k) is None:
            return -1 if src == me else src
        return src

    def _rewind(self, view: EpochView) -> None:
        """A replica mismatch's repair: load this member's copy of the verified state of
        step ``view.restore`` (:class:`~fastft.runtime.state.verified.Verified`)."""
        x = self.x
        assert view.restore is not None
        try:
            step = x.registry.verified.restore(x.registry, view.restore)
        except LookupError as e:
            why = f"rank {x.me.rank} cannot go back to step {view.restore}: {e}"
            x.events.emit("restore_failed", epoch=view.epoch, step=view.restore, error=why)
            log.critical("%s", why)
            raise StateLost(why) from e
        x.events.emit("rewind", epoch=view.epoch, step=step, lost=view.lost)
        log.error(
            "every member went back to its verified state of step %d; steps %d..%d run again",
            step,
            step,
            (view.lost or step) - 1,
        )

    def _recover(self, view: EpochView) -> None:
        """No live member held the committed state (``view.lost``), or a first start
        resumes: load the checkpoint every member loads, or start again from step 0 (the
        source is a fresh process), or end this worker: :attr:`EpochView.fatal`."""
        x = self.x
        do = plans.recover(view, x.config.allow_fresh_start)
        if do is plans.Recover.NONE:
            return
        if do is plans.Recover.REWIND:
            self._rewind(view)
            return
        if do is plans.Recover.RESTORE:
            assert view.restore is not None
            x.registry.verified.forget()  # (of a run this checkpoint does not continue)
            t0 = time.monotonic()
            ckpt = x.durable
            try:
                if ckpt is None:
                    raise CheckpointError("this worker has no --checkpoint-dir")
                step = x.registry.load_state(ckpt.load(ckpt.path_of(view.restore)))
            except Exception as e:
                why = (
                    f"rank {x.me.rank} could not load the checkpoint of step {view.restore} "
                    f"that epoch {view.epoch} restores ({type(e).__name__}: {e}); is "
                    "--checkpoint-dir the same directory on every node?"
                )
                x.events.emit("restore_failed", epoch=view.epoch, step=view.restore, error=why)
                log.critical("%s", why)
                raise StateLost(why) from e
            x.events.emit(
                "restore",
                epoch=view.epoch,
                step=step,
                lost=view.lost,
                redo=None if view.lost is None else view.lost - step,
                load_ms=round((time.monotonic() - t0) * 1e3, 3),
            )
            log.log(*_restored_line(view.lost, step))
            return
        assert view.lost is not None
        if do is plans.Recover.FRESH_START:
            x.events.emit("fresh_start", epoch=view.epoch, lost=view.lost)
            x.registry.verified.forget()
            log.log(*_fresh_line(view.lost))
            return
        if do is plans.Recover.FRESH_RESTART:
            # No fresh process among the members to start from: this one restarts as one.
            x.events.emit("fresh_restart", epoch=view.epoch, lost=view.lost)
            raise SystemExit(f"rank {x.me.rank}: state lost at step {view.lost}; restarting")
        why = (
            f"every holder of the committed state (step {view.lost}) was lost and there is no "
            "checkpoint to restore: the job cannot go on. Run with --checkpoint-dir DIR "
            "(and --checkpoint-every N) to survive this, or --allow-fresh-start to start "
            "again from step 0"
        )
        x.events.emit("state_lost", epoch=view.epoch, lost=view.lost, error=why)
        log.critical("%s", why)
        raise StateLost(why)


def _restored_line(lost: int | None, step: int) -> tuple[int, str]:
    """The log line of a checkpoint of ``step`` loaded: a resume, or a restore after every
    holder of the state of step ``lost`` was lost."""
    if lost is None:
        return logging.WARNING, f"resuming from the checkpoint of step {step}"
    redo = f"; steps {step}..{lost - 1} are trained again" if lost > step else ""
    return logging.ERROR, (
        f"every holder of the committed state (step {lost} at least) was lost: restored "
        f"the checkpoint of step {step}{redo}"
    )


def _fresh_line(lost: int) -> tuple[int, str]:
    """The log line of a fresh start after every holder of step ``lost`` was lost."""
    if lost == 0:  # (nothing was committed: a fresh process holds it all)
        return (
            logging.WARNING,
            "every holder of the initial state was lost: starting from a new one",
        )
    return logging.ERROR, (
        f"every holder of the committed state (step {lost}) was lost and there is no "
        "checkpoint: starting again from step 0 (--allow-fresh-start)"
    )
