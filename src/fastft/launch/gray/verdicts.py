"""What the agent makes of what it sees of its workers: a worker hung (no progress in a
step for ``--hang-timeout``, an interpreter stopped between steps, or
``--between-steps-timeout`` spent there: one reason line, its stacks, then the kill), and
the bus messages it acts on (a drain of its node, a worker's own Fault1 for the
repeat-offender count, a peer's verdict or an outside monitor's report that a worker of
its own is dead: the kill that restarts it). The agent's part for them, as
:class:`~fastft.launch.exits.Exits` is for exits."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import fastft.launch.rules.policy as policy
from fastft.launch.procs.children import Slot, await_signal_taken
from fastft.process.beat import STACKS_SIGNAL, Beat, Wait, hang_limit, read_heartbeat
from fastft.process.sched import KeptOff
from fastft.protocol import DrainRequest, Fault, HangSuspected, Message, Role, Severity

if TYPE_CHECKING:
    from fastft.launch.ports import AgentPorts

__all__ = ["Verdicts"]

log = logging.getLogger(__name__)


class Verdicts:
    """The agent's hang checks and bus verdicts (see the module)."""

    def __init__(self, agent: AgentPorts) -> None:
        self.agent = agent
        self.job_done = False
        """A member marked the job finished (read once a paced verdict asks; never undone)."""
        self._told: set[tuple[int, int, int, int]] = set()
        """The in-process faults already given their line: (rank, incarnation, epoch, step)."""
        self._kept: dict[int, KeptOff] = {}
        """By rank: how long the machine kept its worker off the CPU in its silence."""

    def _fault_line(self, m: Fault) -> None:
        """One ``fastft:`` line for a fault a worker of ours reports of itself and lives
        through (an exception in a step, a state loss): a process fault gets its line
        from the exit (:func:`fastft.launch.exits.fault_line`)."""
        slot = self.agent.slots[m.rank]
        key = (m.rank, m.incarnation, m.epoch, m.step)
        if key in self._told:
            return  # (a reminder of the same fault)
        self._told.add(key)
        if m.severity is Severity.FAULT1:
            what, nxt = "lost its state", "it heals from a peer"
        else:
            what, nxt = "raised", "the step is rolled back and run again"
        print(
            f"fastft: fault: rank {m.rank}.{slot.life} {what} in step {m.step} "
            f"({m.cause[:160]}); {nxt}",
            file=sys.stderr,
            flush=True,
        )

    def check_hang(self, slot: Slot, now: float) -> None:
        a = self.agent
        if slot.done or slot.proc is None or slot.proc.returncode is not None:
            return
        if slot.hung == slot.incarnation:
            return  # reported and killed; its exit is on the way
        hb = read_heartbeat(slot.heartbeat)

        def verdict(by_pace: bool) -> policy.Hung | None:
            return policy.hang_verdict(
                now=now,
                started=slot.started,
                beat=hb.last if hb is not None else None,
                pace=hb.pace if hb is not None else 0.0,
                hang_timeout_s=a.config.hang_timeout_s,
                by_pace=by_pace,
                start_grace_s=a.config.start_grace_s,
                between_since=hb.between if hb is not None else 0.0,
                between_timeout_s=a.config.between_steps_timeout_s,
                unsettled_since=hb.unsettled if hb is not None else 0.0,
                main_beat=hb.main if hb is not None else 0.0,
                waiting_since=hb.waiting if hb is not None else 0.0,
                kept_off=kept_off,
            )

        kept_off = self._kept_off(slot, hb, now) if a.config.hang_pace else 0.0
        hung = verdict(a.config.hang_pace and not self.job_done)
        if hung is not None and hung.paced and self._job_finished():
            # Its peers finished the job: none waits for this worker's last step, so a
            # slow one (a busy machine) proves no hang, and a kill would cost it the
            # script's code after the loop (its new life finds the job over and ends).
            # Only --hang-timeout ends it now.
            hung = verdict(False)
        if hung is None:
            self._deferred(slot, hb, now, kept_off)
            return
        held = self._waiters(slot)
        a.events.emit(
            "worker_hung",
            rank=slot.rank,
            incarnation=slot.incarnation,
            silent_s=round(hung.silent_s, 3),
            timeout_s=round(hung.timeout_s, 3),
            between=hung.between,
            waiters=[r for r, _ in held],
            detected=now,
        )
        line = policy.hang_reason(slot.rank, slot.life, hung)
        if held:
            lives = ", ".join(f"rank {r}.{a.slots[r].life}" for r, _ in held if r in a.slots)
            line += f" ({lives} waited on it)"
        print(f"fastft: {line}", file=sys.stderr, flush=True)
        a.publish(
            HangSuspected(
                **a.header,
                hung_rank=slot.rank,
                hung_incarnation=slot.incarnation,
                silent_for_s=round(hung.silent_s, 3),
                stopped=False,
            )
        )
        inc = slot.incarnation
        slot.hung = inc  # reported once, even if the exit takes a while to be seen
        a.children.kill(slot, STACKS_SIGNAL, incarnation=inc)  # it prints its stacks
        if slot.proc is not None:
            await_signal_taken(slot.proc.pid, STACKS_SIGNAL)
        a.children.kill(slot, incarnation=inc)  # never the restarted life in the slot

    def _kept_off(self, slot: Slot, hb: Beat | None, now: float) -> float:
        """The share of ``slot``'s silence in a step the machine kept it off the CPU
        (:class:`~fastft.process.sched.KeptOff`; 0 between steps, or unpaced)."""
        if hb is None or hb.between or slot.proc is None:
            return 0.0
        limit = hang_limit(hb.pace, self.agent.config.hang_timeout_s)
        if limit >= self.agent.config.hang_timeout_s:
            return 0.0
        kept = self._kept.get(slot.rank)
        if kept is None or kept.pid != slot.proc.pid:
            kept = self._kept[slot.rank] = KeptOff(slot.proc.pid)
        silent = now - max(hb.last, slot.started)
        return kept.share((slot.incarnation, hb.last), silent, limit, now)

    def _deferred(self, slot: Slot, hb: Beat | None, now: float, kept_off: float) -> None:
        """One event when a worker silent past its paced limit is spared because the
        machine kept it off the CPU (``hang_deferred``: its pace no longer judges it)."""
        kept = self._kept.get(slot.rank)
        if hb is None or kept is None or kept.told or kept_off <= 0.0:
            return
        silent = now - max(hb.last, slot.started)
        limit = hang_limit(hb.pace, self.agent.config.hang_timeout_s)
        if silent <= limit or not kept.measured(now, limit):
            return  # (not past the limit, or not measured yet)
        kept.told = True
        self.agent.events.emit(
            "hang_deferred",
            rank=slot.rank,
            incarnation=slot.incarnation,
            silent_s=round(silent, 3),
            timeout_s=round(limit, 3),
            kept_off=round(kept_off, 3),
        )

    def _waiters(self, slot: Slot) -> tuple[tuple[int, int], ...]:
        """The lives of this node that wait on ``slot``'s, directly or through each other
        (their heartbeats name the peer: a heal's other end)."""
        waits_on: dict[tuple[int, int], tuple[int, int]] = {}
        for other in self.agent.slots.values():
            if other is slot or other.done or not other.incarnation:
                continue
            hb = read_heartbeat(other.heartbeat)
            if hb is not None and hb.waiting and hb.waits == Wait.PEER:
                waits_on[(other.rank, other.incarnation)] = (int(hb.on_rank), hb.on_incarnation)
        return policy.waiters((slot.rank, slot.incarnation), waits_on)

    def _job_finished(self) -> bool:
        """Whether a member marked the job finished (it closed after the last step)."""
        a = self.agent
        if self.job_done or a.nodes.store_gone:  # (a call to a silent store never returns)
            return self.job_done
        try:
            # (the get checks the mark's tag: a forged one raises)
            self.job_done = bool(a.store.check([a.keys.finished])) and bool(
                a.store.get(a.keys.finished)
            )
        except Exception:  # (a store that does not answer: the verdict stands)
            log.debug("could not read the job's finished mark", exc_info=True)
        return self.job_done

    def on_message(self, m: Message) -> None:
        a = self.agent
        if (  # a fault a worker of ours reports of itself, living through it: its line
            isinstance(m, Fault)
            and m.sender == (m.faulty_rank, m.faulty_incarnation)
            and m.rank in a.slots
            and a.slots[m.rank].incarnation == m.incarnation
        ):
            self._fault_line(m)
        if isinstance(m, DrainRequest) and m.target_node == a.config.node_rank:
            if a.draining is None:
                a.drain(m.reason or "fastft drain --node")
            return
        if (  # a worker of ours lost its state and lives (an in-process restart): a fault
            isinstance(m, Fault)
            and m.severity is Severity.FAULT1
            and m.sender == (m.faulty_rank, m.faulty_incarnation)
            and m.rank in a.slots
            and a.slots[m.rank].incarnation == m.incarnation
        ):
            a.count_fault(m.rank, m.cause[:200])
            return
        # A worker declared silent by its peers, or whose Fault1 an outside monitor reported
        # (`fastft report-error`: a GPU fallen off the bus; it names no life): kill it if it
        # is one of ours (restart).
        # The verdict names the life it judged: it kills that life only, never a newer one
        # in the slot (a node's "lost" verdict, delivered after its link returned, killed
        # the new life its agent had started meanwhile: issue 60, case 3).
        if isinstance(m, Fault) and m.severity is Severity.FAULT1 and m.rank != m.faulty_rank:
            slot = a.slots.get(m.faulty_rank)
            if slot is None:
                return
            lives = (slot.incarnation, 0) if m.role is Role.MONITOR else (slot.incarnation,)
            if m.faulty_incarnation not in lives:
                a.events.emit(
                    "stale_verdict",
                    rank=slot.rank,
                    incarnation=m.faulty_incarnation,
                    live=slot.incarnation,
                    cause=m.cause[:200],
                )
                return
            if slot.incarnation and not slot.done:
                who = {Role.MONITOR: "a monitor", Role.AGENT: "another node's agent"}.get(
                    m.role, f"rank {m.rank}"
                )
                a.events.emit(
                    "kill_declared_dead",
                    rank=slot.rank,
                    incarnation=slot.incarnation,
                    cause=m.cause,
                    by="monitor" if m.role is Role.MONITOR else who,
                )
                slot.declared = (slot.incarnation, f"declared dead by {who}: {m.cause[:120]}")
                a.children.kill(slot, incarnation=slot.incarnation)


def warn_unfired(run_dir: Path, ranks: set[int], plan: str | None) -> None:
    """At the job's end, a ``fastft:`` line for each fault of the ``--inject`` plan on
    ``ranks`` that no worker fired (a fault without ``life`` on a rank restarted before its
    step never fires, and nothing said so). Without a plan, nothing (the event log is not
    read: a long job's is large)."""
    if plan is None:
        return
    from fastft.process.events import read_events
    from fastft.report.outcome import unfired, unfired_line

    for f in unfired(read_events(run_dir)):
        if f["rank"] in ranks:
            print(f"fastft: warning: {unfired_line(f)}", file=sys.stderr, flush=True)
