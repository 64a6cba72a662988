"""The invariants a simulated run checks after every event, and its liveness.

* one decision per (epoch, step): every member that reads it reads the same;
* S1: a life applies steps one after another from the step it holds, never one twice;
* S3: the state after a commit of step ``s`` is the canonical one (a hash chain of the
  steps' batches), so every member that committed ``s`` holds the same state;
* S4: a member votes for step ``s`` only holding the committed state of ``s``;
* every member adopts the same view of an epoch, and no epoch resumes from a step earlier
  than one a member of it holds;
* a total loss restores, starts again where ``--allow-fresh-start`` allows it, or fails
  the job with its reason, never silently, and only when no member holds the state;
  a finished job ends at the last step;
* a drain never takes away the last copy of the committed state;
* no false death: a member is declared dead for its silence only when it was dead,
  stopped, or something silenced it (a partition, a lost, late or failed message);
* liveness: once the faults stop, the job commits again (or ends) within ``liveness_s``;
  no life waits in a rendezvous (process group, heal, collective) longer than that:
  such a wait is one nothing cancels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.decisions import parse_commit
from fastft.sim.faults import corruption

if TYPE_CHECKING:
    from fastft.sim.life import Life
    from fastft.sim.ports import Host

__all__ = ["Checks"]

SILENCING = ("hang", "partition", "msg_lost", "msg_delay", "store_fail")
"""The faults that may silence a live member (and so make its death a true verdict)."""

_WAITS = ("pg", "heal", "compute", "vote", "form", "join")


class Checks:
    def __init__(self, w: Host) -> None:
        self.w = w
        self.failures: list[str] = []
        self.decisions: dict[tuple[int, int], str] = {}
        self.applied_top = 0
        """The committed state's step: after the last step a member applied."""
        self.views: dict[int, EpochView] = {}
        self.applied: dict[tuple[int, int], set[int]] = {}
        self.commits = 0
        self.last_progress = 0.0
        self.last_fault = 0.0
        self.failed_why: str | None = None

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    def fail(self, what: str) -> None:
        self.w.trace("CHECK", f"FAILED: {what}")
        self.failures.append(f"at {self.w.now * 1e3:.3f} ms: {what}")

    def vote(self, life: Life, epoch: int, step: int) -> None:
        chain = self.w.chain
        if self._corrupt(life, f"votes for step {step}"):
            return
        if life.state.lost_state or life.held != step or life.h != chain[step]:
            self.fail(
                f"S4: {life} votes for step {step} of epoch {epoch} holding "
                f"{'a lost state' if life.h != chain[life.held] else f'step {life.held}'}"
            )

    def decision(self, life: Life, epoch: int, step: int, got: str) -> None:
        kind = got if parse_commit(got) is not None else "R"
        first = self.decisions.setdefault((epoch, step), kind)
        if first != kind:
            self.fail(f"two decisions for epoch {epoch} step {step}: {first!r} and {kind!r}")

    def apply(self, life: Life, step: int) -> None:
        key = (life.state.epoch, step)
        if parse_commit(self.decisions.get(key, "R") or "R") is None:
            self.fail(f"{life} applies step {step} of epoch {key[0]} without a commit decision")
        if life.held != step:
            self.fail(f"S1: {life} applies step {step} holding step {life.held}")
        done = self.applied.setdefault((life.rank, life.inc), set())
        if step in done:
            self.fail(f"S1: {life} applies step {step} twice")
        done.add(step)
        self.applied_top = step + 1

    def restored(self, life: Life, step: int) -> None:
        """The life loaded the checkpoint of ``step``: the steps after it are undone (a
        total loss: they are applied again, once)."""
        done = self.applied.get((life.rank, life.inc), set())
        done -= {s for s in done if s >= step}

    def committed(self, life: Life, step: int) -> None:
        if self._corrupt(life, f"commits step {step}"):
            pass
        elif life.h != self.w.chain[step + 1]:
            self.fail(f"S3: {life} committed step {step} with a state no other member holds")
        self.commits += 1
        self.last_progress = self.w.now

    def view(self, life: Life, view: EpochView) -> None:
        first = self.views.setdefault(view.epoch, view)
        if first != view:
            self.fail(f"{life} adopts another view of epoch {view.epoch}: {view} vs {first}")
            return
        if first is not view:
            return  # (checked at its first adoption)
        w = self.w
        for m in view.members:
            other = w.lives.get(m)
            if other is None or not other.alive or other.h != w.chain[other.held]:
                continue
            if other.held > view.step and view.restore is None and not other.state.lost_state:
                self.fail(
                    f"epoch {view.epoch} resumes from step {view.step} while its member "
                    f"{other} holds step {other.held}"
                )
        if view.fatal or view.restore is not None:  # no holder of the committed state?
            for m in view.members:
                other = w.lives.get(m)
                if other is None or not other.alive or other.state.lost_state:
                    continue
                lost = view.lost
                if lost is not None and other.held == lost and other.h == w.chain[lost]:
                    self.fail(
                        f"epoch {view.epoch} finds no holder of step {view.lost} while its "
                        f"member {other} holds it"
                    )
        # A total loss says which step was lost: exactly, unless the member that records
        # the commits (the first) died before it applied the last one (one step behind).
        top = self.applied_top
        if view.lost is not None and not top - 1 <= view.lost <= top:
            self.fail(
                f"epoch {view.epoch} says step {view.lost} was lost; step {top} was committed"
            )
        fresh = view.lost is not None and view.restore is None and not view.fatal
        if fresh and not w.opts.allow_fresh_start and view.lost:
            self.fail(f"epoch {view.epoch} starts again from step 0 without the flag")

    def declared_dead(self, life: Life, who: Member) -> None:
        """``life`` declares ``who`` dead: silent past the rollback's deadline."""
        w = self.w
        target = w.lives.get(who)
        if target is None or not target.alive or target.frozen:
            return
        if any(f.kind in SILENCING for f in w.plan.faults):
            return
        self.fail(
            f"{life} declared {target} dead for its silence ({target.state.phase.name}), "
            "but it was alive and nothing silenced it"
        )

    def drained(self, life: Life) -> None:
        """A drain never takes away the last copy of the committed state: when ``life``
        leaves drained holding the newest committed step, another member holds it too (one
        that died as ``life`` left, unknown to it, counts), or the durable tier does, or
        the whole job is preempted (every node's agent drains)."""
        w = self.w
        step = life.held
        done = w.outcome is not None or w.store.value(w.keys.finished)
        joiner = life.view is None or not life.view.has(life.me.rank, life.me.incarnation)
        # (every node's agent drains: the job is preempted whole, and its state goes with
        # it unless the durable tier keeps it, as ``fastft run``'s last line says)
        preempted = len(w.draining) == -(-w.opts.world_size // w.opts.per_node)
        if done or joiner or preempted or life.state.lost_state or life.h != w.chain[step]:
            return
        newest = max((o.held for o in w.lives.values() if o.alive), default=0)
        if newest > step or w.checkpoints.get(step) == life.h:
            return

        def holds(o: Life) -> bool:
            known_dead = not o.alive and (o.me in life.dead or o.me.rank in life.state.dead)
            return o.held == step and o.h == life.h and not o.state.lost_state and not known_dead

        if not any(o is not life and holds(o) for o in w.lives.values()):
            self.fail(f"{life} drains holding the only copy of step {step} it knows of")

    def finished(self, life: Life) -> None:
        steps = self.w.opts.steps
        if self._corrupt(life, "finishes"):
            return  # (a bit flipped after the last check: the job could not know)
        if life.held != steps or life.h != self.w.chain[steps]:
            self.fail(f"{life} finishes holding step {life.held}, not the last ({steps})")
        self.last_progress = self.w.now

    def _corrupt(self, life: Life, what: str) -> bool:
        """Whether ``life``'s state is corrupted (a ``bitflip``: the fault's own effect,
        not the protocol's, until the replica check finds it); found and still acting on
        it is a violation."""
        flip = corruption(life.h)
        if flip is None:
            return False
        if flip in self.w.known_corrupt:
            self.fail(f"{life} {what} holding a state the replica check found corrupted")
        return True

    def heal_source(self, receiver: Life, source: Life) -> None:
        """A member the replica check found corrupted never serves a heal."""
        if corruption(source.h) in self.w.known_corrupt:
            self.fail(f"{receiver} heals from {source}, found corrupted by the replica check")

    def job_failed(self, why: str) -> None:
        self.failed_why = why
        if not why:
            self.fail("the job failed without a reason")

    def fault_at(self, t: float) -> None:
        self.last_fault = max(self.last_fault, t)

    def progress(self) -> None:
        """Liveness, after every event."""
        w = self.w
        bound = w.opts.liveness_s
        quiet_since = max(self.last_progress, self.last_fault)
        if w.outcome is None and w.now - quiet_since > bound:
            blocked = "; ".join(
                f"{life} {life.state.phase.name} in {life.pc[0]} since {life.since * 1e3:.1f} ms"
                for life in w.lives.values()
                if life.alive
            )
            self.fail(f"no commit for {bound:g} s after the last fault: {blocked}")

    def at_end(self) -> None:
        w = self.w
        if self.failed:
            return
        if w.outcome == "finished":
            missing = [r for r, s in w.slots.items() if not s.done]
            if missing:
                self.fail(f"the job finished with ranks {missing} still running")
        elif w.outcome is not None and not w.outcome.startswith(("failed: ", "preempted: ")):
            self.fail(f"the job ended silently: {w.outcome}")
