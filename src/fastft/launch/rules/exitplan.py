"""The agent's reaction to a worker's exit, written once: a pure plan from a frozen view of
the slot and the agent (:class:`Exited`, :class:`AgentSeen`). The agent
(:class:`~fastft.launch.exits.Exits`) and the simulated agents
(:class:`~fastft.sim.agents.Agents`) both call it and only carry it out (issue 63).

Three steps, because the agent's records change between them: :func:`fault_of` (is the
exit the worker's own failure, to count against its slot: a count that may quarantine
the slot), :func:`exit_plan` (restart, done or fail, from the policy of
:func:`fastft.launch.rules.policy.after_exit` and the start-up rule), and :func:`floor` (a slot
done for good: can the others still form a world? read only when the plan asks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from fastft.launch.rules import policy
from fastft.protocol.exits import ENDS_THE_JOB, EXIT_DRAINED

__all__ = ["AgentSeen", "ExitPlan", "Exited", "exit_plan", "fault_of", "floor"]


@dataclass(frozen=True)
class Exited:
    """A worker's exit as its agent saw it."""

    rank: int
    code: int | None
    sig: int | None
    life: int
    """The slot's life (0: its first)."""
    drains: int = 0
    """Lives of the slot that ended by a drain or a fence (no restart used up)."""
    ours: bool = True
    """A status of fastft's, recorded by the worker (not the script's own)."""
    done: bool = False
    """The slot was marked done before (its worker finished, or the job's end)."""
    hung: bool = False
    """The agent killed this life as hung."""
    joined: bool = True
    """The worker started fastft (its runtime wrote the heartbeat)."""
    committed: bool = False
    """This life committed a step."""
    taken_down: bool = False
    """The agent killed it with its shard group."""
    fenced: bool = False
    """The agent killed it because its node was declared lost."""
    replaced: bool = False
    """A straggler asked to drain: its exit starts the slot again."""


@dataclass(frozen=True)
class AgentSeen:
    """The agent's side at the exit: its configuration and what it is doing."""

    max_restarts: int
    world_size: int
    min_replicas: int | None = None
    shard_size: int = 1
    plain: bool = False
    """torchft's baseline (``--torchft plain``)."""
    stopping: bool = False
    failed: bool = False
    draining: bool = False
    peers_finished: bool = False
    """Another slot's worker ended the job cleanly already."""
    spares_left: bool = False
    first_lives: Mapping[int, bool | None] = dataclasses.field(default_factory=dict)
    """Rank -> whether its first life failed before its first commit (None: running)."""

    @property
    def elastic(self) -> bool:
        return self.min_replicas is not None and self.min_replicas < self.world_size

    @property
    def ending(self) -> bool:
        return self.stopping or self.draining or self.failed


def fault_of(e: Exited, a: AgentSeen) -> str | None:
    """What the exit counts as against its slot (``hung``, ``code 1``, ``signal 9``), or
    None: not a failure of the worker itself but an exit the agent caused or expected (a
    clean end, a stop, a failed job, a drain, a group taken down, a fence)."""
    own = (
        e.code != 0
        and not (e.code == EXIT_DRAINED and e.ours)
        and not e.done
        and not a.ending
        and not e.taken_down
        and not e.fenced
    )
    if not own:
        return None
    return "hung" if e.hung else _how(e)


@dataclass(frozen=True)
class ExitPlan:
    """What the agent does with an exited worker's slot."""

    then: policy.AfterExit
    """Restart, done, failed, shrink, a spare only (the policy's, or the start-up rule's)."""
    own: bool
    """The worker's own failure: one ``fastft: fault:`` line in every log."""
    finished: bool = False
    """It ended well (status 0): the job's end, when it was the job's last step."""
    never_joined: bool = False
    """It exited 0 without starting fastft: warn (a script that never called init)."""
    first_failed: bool | None = None
    """The slot's first life ended: whether before its first commit (the agent's ledger
    records it); None: not the first life's end."""
    startup: bool = False
    """Every slot's first life failed before its first commit: the job fails as a whole."""
    check_floor: bool = False
    """The slot is done for good: count the slots left and ask :func:`floor`."""
    free: bool = False
    """A restart that uses up none (a drain, or a fence of a node declared lost)."""
    group: bool = False
    """Take the rest of its shard group down with it (the group starts again whole)."""


def exit_plan(e: Exited, a: AgentSeen, quarantined: str | None = None) -> ExitPlan:
    """The plan for ``e`` (``quarantined``: why the slot is quarantined, after its fault
    was counted: :func:`fault_of`)."""
    own = fault_of(e, a) is not None
    failed = own and not e.hung  # (hung: the hang timeout's)
    first = e.life == 0 and e.rank in a.first_lives and a.first_lives[e.rank] is None
    first_failed = (failed and not e.committed) if first else None
    never_joined = e.code == 0 and not a.plain and not e.joined
    # (a status that names its own reason, a script error: the policy says it)
    names_why = e.ours and e.code in ENDS_THE_JOB
    if first and policy.startup_failed({**a.first_lives, e.rank: first_failed}) and not names_why:
        why = (
            f"every worker failed before its first commit (rank {e.rank}: {_how(e)}); "
            "the script cannot start: its error is above"
        )
        then = policy.AfterExit(done=True, failed=why)
        return ExitPlan(
            then, own, never_joined=never_joined, first_failed=first_failed, startup=True
        )
    then = policy.after_exit(
        rank=e.rank,
        code=e.code,
        sig=e.sig,
        life=e.life - e.drains,
        max_restarts=a.max_restarts,
        stopping=a.stopping,
        already_done=e.done,
        peers_finished=a.peers_finished,
        spares_left=a.spares_left,
        elastic=a.elastic,
        draining=a.draining,
        quarantined=quarantined,
        ours=e.ours,
        replaced=e.replaced,
    )
    return ExitPlan(
        then,
        own,
        finished=e.code == 0,
        never_joined=never_joined,
        first_failed=first_failed,
        check_floor=(
            then.done
            and not then.failed
            and e.code != 0
            and not a.peers_finished
            and not a.ending
            and a.elastic
        ),
        free=then.restart and (e.code == EXIT_DRAINED and e.ours or e.fenced),
        group=then.restart and a.shard_size > 1,
    )


def floor(plan: ExitPlan, left: int | None, a: AgentSeen) -> ExitPlan:
    """``plan`` once the slots that can still run were counted (``left``; None: the store
    could not say, no verdict): the job fails if an elastic world fell below its floor."""
    lost = None if left is None else policy.floor_lost(left, a.min_replicas, a.world_size)
    if lost is None:
        return plan
    return dataclasses.replace(plan, then=dataclasses.replace(plan.then, failed=lost))


def _how(e: Exited) -> str:
    return f"code {e.code}" if e.sig is None else f"signal {e.sig}"
