"""The simulated node agents: what they do with their workers' exits (the agent's own
plan, :mod:`fastft.launch.rules.exitplan`), a peer's verdict that a worker
is dead, a hang past the timeout, and a node cut off (the lease, the fence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastft.launch.gray.stragglers import StragglerWatch, slow_members
from fastft.launch.rules import exitplan, policy
from fastft.launch.rules.offenders import Offenders
from fastft.protocol import (
    DrainRequest,
    Fault,
    HangSuspected,
    JobKeys,
    Message,
    ProcessExited,
    Role,
    Severity,
)
from fastft.protocol.exits import FASTFT_STATUSES
from fastft.runtime.contract import Member
from fastft.sim.checks import Checks
from fastft.sim.judge import judge
from fastft.sim.life import Life
from fastft.sim.options import Options
from fastft.sim.store import SimStore

__all__ = ["JUDGED_AFTER_S", "STRAGGLER_CHECK_S", "Agents", "Slot"]

STRAGGLER_CHECK_S = 0.5
"""How often the agents compare the members' compute (``EXCHANGE_S``)."""
JUDGED_AFTER_S = 0.001
"""A stopped life is judged this long after its hang timeout (the rule is strict)."""


@dataclass
class Slot:
    """A node agent's view of one rank: its current life, how many it had, done."""

    rank: int
    life: Member | None = None
    lives: int = 0
    done: bool = False
    finished: bool = False
    drains: int = 0
    first: bool | None = None
    """Whether its first life failed before its first commit (None: running)."""


class Agents:
    """The agents' part of :class:`~fastft.sim.world.World` (its base)."""

    opts: Options
    store: SimStore
    keys: JobKeys
    lives: dict[Member, Life]
    slots: dict[int, Slot]
    outcome: str | None
    checks: Checks
    partitioned: set[int]
    stragglers: StragglerWatch
    replacing: set[Member]
    offenders: Offenders
    spares: dict[int, int]
    owed: list[tuple[Member, float]]
    draining: set[int]
    spare_starts: int
    now: float

    def at(self, delay: float, kind: str, *args: Any) -> None:
        raise NotImplementedError

    def draw(self, lo: float, hi: float) -> float:
        raise NotImplementedError

    def broadcast(self, sender: Life | None, m: Message) -> None:
        raise NotImplementedError

    def end_life(
        self, life: Life, code: int | None, sig: int | None, why: str, by: str = ""
    ) -> None:
        raise NotImplementedError

    def schedule_main(self, life: Life, delay: float) -> None:
        raise NotImplementedError

    # --- the agents ---------------------------------------------------------------------
    def agent_message(self, rank: int, m: Message) -> None:
        """:class:`fastft.launch.gray.verdicts.Verdicts`: a peer's verdict that a worker of this
        slot is dead kills it (its restart heals)."""
        slot = self.slots[rank]
        if not (isinstance(m, Fault) and m.severity is Severity.FAULT1):
            return
        if m.rank == m.faulty_rank or m.faulty_rank != rank or slot.life is None:
            return
        life = self.lives[slot.life]
        lives = (life.inc, 0) if m.role is Role.MONITOR else (m.faulty_incarnation,)
        if m.faulty_incarnation in lives and life.alive and not slot.done:
            self.end_life(life, None, 9, f"declared dead by rank {m.rank}")

    def agent_header(self, rank: int) -> dict[str, Any]:
        return dict(job=self.keys.job, epoch=0, rank=-1, incarnation=1 + rank, role=Role.AGENT)

    def _on_exit_seen(self, who: Member, code: int | None, sig: int | None) -> None:
        """:meth:`fastft.launch.exits.Exits.after_exit`: the exit reported, then the same
        plan (:mod:`fastft.launch.rules.exitplan`) carried out on the simulated slots."""
        slot = self.slots[who.rank]
        life = self.lives[who]
        head = self.agent_header(who.rank)
        self.broadcast(
            None,
            ProcessExited(
                **head,
                exited_rank=who.rank,
                exited_incarnation=who.incarnation,
                exit_code=code,
                signal=sig,
                ending=code in FASTFT_STATUSES,  # (a simulated worker's statuses are fastft's)
            ),
        )
        self.store.agent_compare_set(self.keys.joiner(who.rank), str(who.incarnation), "")
        if slot.life != who:
            return
        e = exitplan.Exited(
            rank=who.rank,
            code=code,
            sig=sig,
            life=slot.lives - 1,
            drains=slot.drains,
            done=slot.done,
            hung=life.ended_by == "hung",
            committed=life.commits > 0,
            fenced=life.ended_by == "fenced",
            replaced=who in self.replacing,
        )
        o = self.opts
        node = who.rank // o.per_node
        seen = exitplan.AgentSeen(
            max_restarts=o.max_restarts,
            world_size=o.world_size,
            min_replicas=o.min_replicas if o.elastic else None,
            stopping=self.outcome is not None,
            peers_finished=any(s.finished for s in self.slots.values()),
            first_lives={r: s.first for r, s in self.slots.items()},
            spares_left=self.spares[node] > 0,
            draining=node in self.draining,
        )
        what = exitplan.fault_of(e, seen)
        if what is not None:
            self.offenders.fault(who.rank, self.now, what)
        do = exitplan.exit_plan(e, seen, self.offenders.quarantined.get(who.rank))
        if do.first_failed is not None:
            slot.first = do.first_failed
        if do.check_floor:  # (the simulated job's count: its slots not done for good)
            do = exitplan.floor(
                do, sum(not s.done for s in self.slots.values() if s is not slot), seen
            )
        self._perform(slot, do)

    def _perform(self, slot: Slot, do: exitplan.ExitPlan) -> None:
        then = do.then
        if do.finished:
            slot.finished = True
        if then.failed:
            self.outcome = f"failed: {then.failed}"
            self.checks.job_failed(then.failed)
            return
        if then.done:
            slot.done = True
            self.all_done()
            return
        if do.free:
            slot.drains += 1
        if then.restart:
            if then.spare_only:  # (:meth:`fastft.launch.agent.Agent`'s start on a spare)
                self.offenders.replaced(slot.rank)
            node = slot.rank // self.opts.per_node
            spare = self.spares[node] > 0  # (the agent's restart takes a ready spare)
            if spare:
                self.spares[node] -= 1
                self.spare_starts += 1
            lo, hi = self.opts.spare_s if spare else self.opts.restart_s
            self.at(max(then.delay_s, self.draw(lo, hi)), "spawn", slot.rank, spare)

    def all_done(self) -> None:
        """Every slot done: the job finished, was preempted (every node drained), or
        failed."""
        if not all(s.done for s in self.slots.values()):
            return
        if any(s.finished for s in self.slots.values()):
            self.outcome = "finished"
        elif self.draining:
            self.outcome = "preempted: every worker drained"  # (the agent exits 143)
        else:
            self.outcome = "failed: every slot is gone"

    # --- warm spares (:class:`fastft.launch.procs.spares.SparePool`) ---------------------
    def owe(self, life: Member) -> None:
        """A spare became ``life``: its replacement is owed (:func:`policy.spare_owed_done`)."""
        self.owed.append((life, self.now + policy.SPARE_REFILL_MAX_S))
        if len(self.owed) == 1:
            self.at(0.05, "spares_owed")

    def _on_spares_owed(self) -> None:
        keep = []
        for who, deadline in self.owed:
            slot, life = self.slots[who.rank], self.lives[who]
            if policy.spare_owed_done(
                now=self.now,
                deadline=deadline,
                same_life=slot.life == who,
                slot_done=slot.done,
                committed=life.commits > 0,
            ):  # a new spare warms up as a cold start does
                self.at(
                    self.draw(*self.opts.restart_s), "spare_ready", who.rank // self.opts.per_node
                )
            else:
                keep.append((who, deadline))
        self.owed = keep
        if keep:
            self.at(0.05, "spares_owed")

    def _on_spare_ready(self, node: int) -> None:
        if self.outcome is None and node not in self.draining:
            self.spares[node] += 1

    # --- the agent's own drain (:meth:`fastft.launch.agent.Agent.drain`) -----------------
    def node_drain(self, node: int, replaced_after: float = 0.0) -> None:
        """The node's agent got a SIGTERM: each of its workers drains at its next commit
        (its SIGTERM handler, ``ft.drain``), none is restarted; after the grace the agent
        stops the ones still there. ``replaced_after``: then the scheduler starts the
        node's agent again (its workers new lives, which join), unless the job ended."""
        if node in self.draining:
            return
        if replaced_after:
            self.at(replaced_after, "node_replaced", node)
        self.draining.add(node)
        for life in self.node_lives(node):
            self.broadcast(
                None,
                DrainRequest(
                    **self.agent_header(life.rank), target_rank=life.rank, reason="SIGTERM"
                ),
            )
        self.at(self.opts.drain_grace_s, "drain_late", node)

    def _on_drain_late(self, node: int) -> None:
        if node in self.draining:
            for life in self.node_lives(node):
                self.end_life(life, None, 9, "stopped after the drain's grace")

    def _on_node_replaced(self, node: int) -> None:
        """A new agent on the drained node (the old one ended once its workers left, or
        stopped them at its grace): its ranks start again as new lives."""
        if self.outcome is not None or node not in self.draining:
            return
        self._on_drain_late(node)  # (the old agent's grace: it stopped the rest)
        self.draining.discard(node)
        per = self.opts.per_node
        for r, slot in sorted(self.slots.items()):
            if r // per == node and slot.done and not slot.finished:
                slot.done = False
                self.at(self.draw(*self.opts.restart_s), "spawn", r)

    def _on_straggler_check(self) -> None:
        """:class:`fastft.launch.gray.stragglers.Stragglers` with ``--stragglers replace``:
        every live member's compute (a straggler's 3x), the slow ones named once a life,
        drained; their exit restarts the slot."""
        live = [x for x in self.lives.values() if x.alive and not x.frozen]
        computes = {x.rank: (x.inc, 0.010 * x.slow) for x in live}
        epochs = {x.rank: x.state.epoch for x in live}  # (figures of one epoch compared)
        for s in self.stragglers.newly(slow_members(computes, 1.3, epochs)):
            life = self.lives[Member(s.rank, s.incarnation)]
            self.replacing.add(life.me)
            self.broadcast(
                None,
                DrainRequest(
                    **self.agent_header(s.rank), target_rank=s.rank, reason="straggler: 3x"
                ),
            )
        if any(x.slow > 1 for x in live):
            self.at(STRAGGLER_CHECK_S, "straggler_check")

    def _on_hang_seen(self, who: Member) -> None:
        """The stopped life's hang timeout has passed: the agents judge every life they
        see (the real rule, :mod:`fastft.sim.judge`); the stopped one is hung, no other."""
        life = self.lives[who]
        if not life.alive or not life.frozen or who.rank // self.opts.per_node in self.partitioned:
            return
        seen = [
            x
            for x in self.lives.values()
            if x.alive and x.rank // self.opts.per_node not in self.partitioned
        ]
        verdicts = judge(seen, self.now, self.opts.hang_timeout_s)
        for other, hung in verdicts.items():
            if not other.frozen:
                self.checks.fail(
                    f"{other} judged hung ({hung.silent_s:.3f} s, in {other.pc[0]}) while "
                    f"{life} is the one stopped"
                )
        if life not in verdicts:
            self.checks.fail(f"{life} stopped for {self.now - life.frozen_at:.3f} s: not hung")
        head = self.agent_header(who.rank)
        self.broadcast(
            None,
            HangSuspected(
                **head,
                hung_rank=who.rank,
                hung_incarnation=who.incarnation,
                silent_for_s=2.0,
                stopped=False,
            ),
        )
        self.end_life(life, None, 9, "hung: killed by its agent", by="hung")

    def node_lives(self, node: int) -> list[Life]:
        per = self.opts.per_node
        return [
            self.lives[s.life]
            for r, s in sorted(self.slots.items())
            if r // per == node and s.life is not None and self.lives[s.life].alive
        ]

    def partition(self, node: int, duration: float) -> None:
        """The node is cut off: its lives stop (their store calls and messages wait); past
        the lease the others declare its lives dead; when it returns, a node declared lost
        kills its stale lives (they restart and heal), else they go on."""
        self.partitioned.add(node)
        for life in self.node_lives(node):
            life.freeze()
        if duration > self.opts.lease_s:
            self.at(self.opts.lease_s, "node_lost", node)
        self.at(duration, "node_back", node, duration > self.opts.lease_s)

    def _on_node_lost(self, node: int) -> None:
        for life in self.node_lives(node):
            fault = Fault(
                **self.agent_header((node + 1) * self.opts.per_node % self.opts.world_size),
                severity=Severity.FAULT1,
                cause=f"node {node} lost",
                faulty_rank=life.rank,
                faulty_incarnation=life.inc,
            )
            self.broadcast(None, fault)

    def _on_node_back(self, node: int, lost: bool) -> None:
        self.partitioned.discard(node)
        for life in self.node_lives(node):
            if lost:
                self.end_life(life, None, 9, "fenced: its node was declared lost", by="fenced")
                continue
            life.frozen = False
            for m in life.buffered:
                self.at(0.0, "deliver", life.me, m)
            life.buffered.clear()
            self.schedule_main(life, 0.0)
