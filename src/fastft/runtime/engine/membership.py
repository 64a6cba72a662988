"""Votes and epochs on the main thread: the executor's store-facing actions (join, form
the next epoch, adopt it, vote and wait for the decision). The decisions themselves are
the state machine's and :mod:`fastft.runtime.engine.formation`'s; this module performs them."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NoReturn

from fastft.fsm import CastVote, Decision, FormEpoch, Phase, QuorumReady
from fastft.protocol import JoinRequest
from fastft.runtime.contract import EpochView
from fastft.runtime.durable.checkpoints import CheckpointError
from fastft.runtime.endings import JobFinished, StateLost, WorkerExit
from fastft.runtime.engine.decisions import parse_commit
from fastft.runtime.engine.formation import others_hold_state
from fastft.runtime.engine.sideclient import KeyCollector
from fastft.runtime.engine.survivors import Survivors
from fastft.runtime.groups.hsdp import heal_group, shard_source, whole_groups

if TYPE_CHECKING:
    from fastft.runtime.engine.ports import Engine

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, x: Engine) -> None:
        self.x = x
        self.survivors = Survivors(x.coord)
        self.collector = KeyCollector(x.side)
        self._decision_wait_ms: float | None = None
        self._below: tuple[int, int, int] | None = None

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
        view = self.x.view
        if view is not None and view.index(self.x.me.rank) == 0:
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
        if a.agreed:  # decided by the step's collective: no store request
            self._decision_wait_ms = 0.0
            x.feed(Decision(commit=True))
            return
        joining = a.joining
        if joining and x.dp.k > 1:  # admit a restarted shard group once all of it is there
            joining = bool(whole_groups(x.coord.joiners(), x.dp.k))
        got = x.coord.vote(
            a.epoch,
            a.step,
            len(view.members),
            leaving=a.want_drain,
            joining=joining,
            ranks=tuple(sorted(view.ranks)),
        )
        while got is None:
            got = x.coord.await_decision(a.epoch, a.step)
            if x.closing:
                break
            x.sv.heartbeat.beat()
        parsed = parse_commit(got) if got is not None else None
        commit = parsed is not None
        admit, leaving = parsed if parsed is not None else (False, frozenset[int]())
        if commit and view.index(x.me.rank) == 0 and a.step > 0:
            self.collector.put(a.epoch, a.step - 1)  # every member has read it by now
        wait_ms = round((time.monotonic() - t0) * 1e3, 3)
        if commit and not admit and not leaving:  # the fault-free path: the commit's line
            self._decision_wait_ms = wait_ms
        else:
            x.events.emit(
                "decision",
                epoch=a.epoch,
                step=a.step,
                decision="commit" if commit else "rollback",
                reason=None if commit or got is None else got[1:],
                admit=admit,
                leaving=sorted(leaving),
                wait_ms=wait_ms,
            )
        x.feed(Decision(commit=commit, admit=admit, leaving=leaving))

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
        try:
            view = x.coord.form_as_joiner(
                start_timeout_s=x.config.start_timeout_s,
                regroup_timeout_s=x.config.regroup_timeout_s,
                cancelled=lambda: base() or x.state.want_drain,
                announce=self._announce_join,
            )
        except JobFinished as e:
            self._finished(e, str(e))
            raise
        if view is not None:
            self.adopt(view, waited_s=time.monotonic() - t0)
        elif x.state.want_drain:
            # asked to drain while waiting to join: it holds nothing the job needs (no
            # epoch, no committed state of its own), so it leaves now, not after the
            # agent's grace (30 s, found by the elastic chaos soak)
            x.events.emit("drain_from_join")
            raise WorkerExit("asked while it waited to join")

    def form(self, a: FormEpoch) -> None:
        x = self.x
        prev = x.view
        assert prev is not None
        t0 = time.monotonic()
        exclude = a.exclude | frozenset(m.rank for m in prev.members if m in x.dead)
        base = x.cancelled(Phase.HEALING)

        def cancelled() -> bool:
            return base() or self._may_drain(prev, exclude)

        # what it holds is the committed state: not lost, not suspect, and healed if its
        # epoch began by healing it (a member commits only once it holds the state)
        healed = x.me.rank not in prev.needs_state or x.state.step > prev.step
        holds = healed and not a.lost_state and not x.suspect_state
        self._drain_from_formation(prev, exclude, holds)
        try:
            view = self.survivors.form(
                prev,
                exclude,
                step=x.state.step,
                lost_state=a.lost_state,
                timeout_s=x.config.rollback_timeout_s,
                cancelled=cancelled,
                kept=x.kept.of_step(x.state.step),
                # elastic: the retry goes on without workers still to heal (admitted after
                # the next commit); a fixed world cannot step without them
                admit=not (a.rollback and x.config.elastic),
                # tests: a death after arriving for the epoch
                arrived=lambda: x.sv.injector.fire_due(x.state.step, point="formation"),
                suspect=x.suspect_state,
                # (lost on purpose: the verified step it goes back to; else the one it holds)
                rewind=x.registry.verified.wanted if a.lost_state else x.registry.verified.step,
                below_min=self._below_min,
                silent=x.declare_silent,
                remind=x.remind,
            )
        except JobFinished as e:
            self._finished(e, f"the job finished at step {e.step} while this worker re-formed")
            raise
        if view is None:
            self._drain_from_formation(prev, exclude, holds)
            return
        x.suspect(False)  # (healed in this epoch, or the source: every state equal)
        if not view.has(x.me.rank, x.me.incarnation):
            x.events.emit("excluded", epoch=view.epoch)
            x.feed(QuorumReady(view.epoch, view.ranks, view.step, view.needs_state))
            return
        self.adopt(view, waited_s=time.monotonic() - t0)

    def _may_drain(self, prev: EpochView, gone: frozenset[int]) -> bool:
        """Asked to drain, and another live member, not ``gone`` (leaving the epoch), holds
        the committed state."""
        x = self.x
        s = x.state
        return s.want_drain and others_hold_state(prev, x.me, x.dead, s.step, gone | s.leaving)

    def _drain_from_formation(self, prev: EpochView, gone: frozenset[int], holds: bool) -> None:
        """A worker asked to drain while its epoch re-forms leaves at once if another live
        member holds the committed state (it has no step in flight; peers that count on it
        see an exit); with ``--checkpoint-dir``, one that ``holds`` it writes it first. The
        last holder stays: it heals the others and leaves at its next commit
        (:func:`~fastft.runtime.engine.formation.others_hold_state`); with nobody to heal
        (no joiner registered: the whole job drains) and the state in a checkpoint (written
        now if need be), it leaves too."""
        x = self.x
        s = x.state
        if self._may_drain(prev, gone):
            if holds:
                x.checkpoints.leaving(s.step, s.epoch)
            x.events.emit("drain_from_formation", step=s.step)
            raise WorkerExit("left while its epoch re-formed, another member holding the state")
        if not s.want_drain:
            return
        if holds and not x.coord.joiners() and x.checkpoints.covers(s.step, s.epoch):
            # the last holder, and nobody to heal (the whole job drains: a preemption):
            # the state it holds is in a checkpoint, so it leaves with the others (it
            # waited out the drain's grace and was stopped, the agent's line untrue)
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
        if view.restore is not None or view.lost is not None:
            self._recover(view)
        x.sv.heartbeat.new_world(view.epoch)  # (its figures start again: a new share)
        with x.lock:
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
        if view.rewind and view.restore is not None:
            self._rewind(view)
            return
        if view.restore is not None:
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
            if view.lost is None:
                log.warning("resuming from the checkpoint of step %d", step)
            else:
                log.error(
                    "every holder of the committed state (step %d at least) was lost: "
                    "restored the checkpoint of step %d%s",
                    view.lost,
                    step,
                    f"; steps {step}..{view.lost - 1} are trained again"
                    if view.lost > step
                    else "",
                )
            return
        assert view.lost is not None
        if not view.fatal:  # a fresh start that --allow-fresh-start allowed
            x.events.emit("fresh_start", epoch=view.epoch, lost=view.lost)
            x.registry.verified.forget()
            if view.lost == 0:  # (nothing was committed: a fresh process holds it all)
                log.warning("every holder of the initial state was lost: starting from a new one")
                return
            log.error(
                "every holder of the committed state (step %d) was lost and there is no "
                "checkpoint: starting again from step 0 (--allow-fresh-start)",
                view.lost,
            )
            return
        if x.config.allow_fresh_start:
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
