"""What the agent does when a worker exits or stops: report it on the bus once (the exit
trace and ``waitid`` may both see it), then restart the slot, mark it done or fail the job
(:func:`fastft.launch.rules.policy.after_exit` decides). The agent's part for it, as
:class:`~fastft.runtime.engine.membership.Membership` is the executor's: it uses the agent's
state (``slots``, ``children``, ``spares``, ``events``, ``store``, ``keys``)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import fastft.launch.rules.policy as policy
from fastft.launch.procs.children import Slot
from fastft.launch.rules import exitplan
from fastft.process.beat import read_heartbeat
from fastft.protocol import HangSuspected, ProcessExited
from fastft.protocol.exits import FASTFT_STATUSES, ending_path

if TYPE_CHECKING:
    from fastft.launch.ports import AgentPorts

__all__ = ["Exits", "back_line", "fault_line"]

log = logging.getLogger(__name__)


class Exits:
    """Exits and stops of the agent's workers (see the module's docstring)."""

    def __init__(self, agent: AgentPorts) -> None:
        self.agent = agent
        self._count_lock = threading.Lock()
        """Faults are counted from the reaper threads and the bus listener alike."""

    def on_other_exit(self, info: os.waitid_result) -> None:
        if self.agent.spares.mark_dead(info.si_pid) and self.agent.stopping is None:
            self.agent.spares.idle_exited(info)

    def on_stopped(self, slot: Slot, t: float, via: str) -> None:
        with self.agent.children.lock:  # the exit trace and waitid may both see it
            if slot.stopped == slot.incarnation:
                return
            slot.stopped = slot.incarnation
        self.agent.events.emit(
            "worker_stopped", rank=slot.rank, incarnation=slot.incarnation, detected=t, via=via
        )
        if self.agent.config.torchft == "plain":
            slot.hung = slot.incarnation  # torchft's baseline: left to torchft's timeouts
            return
        self.agent.publish(
            HangSuspected(
                **self.agent.header,
                hung_rank=slot.rank,
                hung_incarnation=slot.incarnation,
                silent_for_s=0.0,
                stopped=True,
            )
        )
        self.agent.children.kill(slot)

    def claim_exit(
        self, slot: Slot, pid: int, code: int | None, sig: int | None, t: float, via: str
    ) -> bool:
        """Report the exit of ``pid`` once; False if it was reported already."""
        if not self.agent.children.claim(slot, pid):
            return False
        assert slot.proc is not None and slot.proc.pid == pid
        slot.proc.returncode = code if code is not None else -(sig or 0)
        slot.ending = self.ending(slot, code)
        self.agent.events.emit(
            "worker_exit",
            rank=slot.rank,
            incarnation=slot.incarnation,
            exit_code=code,
            signal=sig,
            life=slot.life,
            detected=t,
            via=via,
            **({"ending": slot.ending} if code in FASTFT_STATUSES else {}),
        )
        self.agent.publish(
            ProcessExited(
                **self.agent.header,
                exited_rank=slot.rank,
                exited_incarnation=slot.incarnation,
                exit_code=code,
                signal=sig,
                ending=slot.ending is not None,
            )
        )
        return True

    def ending(self, slot: Slot, code: int | None) -> str | None:
        """Why the worker ended with ``code``, if it is a status of fastft's and the worker
        recorded it so (else the status is the script's own: None). The record is read
        once and removed."""
        path = ending_path(str(self.agent.run_dir), slot.rank, slot.incarnation)
        try:
            with open(path) as f:
                got = json.load(f)
            os.unlink(path)
        except (OSError, ValueError):
            return None
        if code not in FASTFT_STATUSES or not isinstance(got, dict) or got.get("status") != code:
            return None
        return str(got.get("why") or f"status {code}")

    def after_exit(self, slot: Slot, code: int | None, sig: int | None) -> None:
        """Carry out :mod:`fastft.launch.rules.exitplan`'s plan for the exit of ``slot``'s worker."""
        self.forget_joiner(slot)
        agent = self.agent
        e, seen = self.exited(slot, code, sig), self.seen()
        what = exitplan.fault_of(e, seen)
        if what is not None:
            self.count_fault(slot.rank, what)
            slot.fault_at = time.monotonic()
        do = exitplan.exit_plan(e, seen, agent.offenders.quarantined.get(slot.rank))
        if do.never_joined:
            agent.events.emit("never_joined", rank=slot.rank, life=slot.life)
            print(
                f"fastft: WARNING: rank {slot.rank} exited 0 without calling fastft.init(): it "
                "never joined the job (a script under `fastft run` calls ft = fastft.init(), "
                "ft.register(model=..., optimizer=...) and runs its steps in "
                "`with ft.transaction():`)",
                file=sys.stderr,
                flush=True,
            )
        if do.first_failed is not None:
            agent.ledger.first_life_ended(slot.rank, failed=do.first_failed)
        if do.check_floor:
            do = exitplan.floor(do, self._slots_left(slot), seen)
        self._perform(slot, code, sig, do)

    def exited(self, slot: Slot, code: int | None, sig: int | None) -> exitplan.Exited:
        """The frozen view of ``slot``'s exit its plan is made from."""
        ledger = self.agent.ledger
        return exitplan.Exited(
            rank=slot.rank,
            code=code,
            sig=sig,
            life=slot.life,
            drains=slot.drains,
            ours=slot.ending is not None,  # (a status of fastft's, recorded: not the script's)
            done=slot.done,
            hung=slot.hung == slot.incarnation,
            joined=code != 0 or _joined(slot),
            committed=self.agent.committed(slot),
            taken_down=ledger.taken_down(slot.incarnation),
            fenced=ledger.fenced(slot.incarnation),
            replaced=ledger.replaced(slot.incarnation),
        )

    def seen(self) -> exitplan.AgentSeen:
        """The frozen view of the agent an exit's plan is made from."""
        agent, cfg = self.agent, self.agent.config
        return exitplan.AgentSeen(
            max_restarts=cfg.max_restarts,
            world_size=cfg.world_size,
            min_replicas=cfg.min_replicas,
            shard_size=cfg.shard_size,
            plain=cfg.torchft == "plain",
            stopping=agent.stopping is not None,
            failed=bool(agent.failed),
            draining=agent.draining is not None,
            # (another slot's worker ended the job cleanly already)
            peers_finished=any(
                s.done and s.proc is not None and s.proc.returncode == 0
                for s in agent.slots.values()
            ),
            spares_left=bool(agent.spares),
            first_lives=dict(agent.ledger.first_lives),
        )

    def _perform(
        self, slot: Slot, code: int | None, sig: int | None, do: exitplan.ExitPlan
    ) -> None:
        agent, then = self.agent, do.then
        if do.startup:
            slot.done = True
            agent.fail(then.failed or "")
            return
        if do.own:  # one line per fault in every log, a terminal or not
            print(fault_line(slot, code, sig, then), file=sys.stderr, flush=True)
        if then.failed:
            agent.fail(then.failed)
        if then.shrink:
            agent.events.emit("world_shrinks", rank=slot.rank, reason=then.shrink)
            log.warning("the world goes on without rank %d: %s", slot.rank, then.shrink)
        slot.spare_only = then.spare_only
        if then.done:
            slot.done = True
        if do.group:
            self._restart_group(slot)
        if do.free:
            slot.drains += 1
        if then.restart:
            slot.life += 1
            agent.ledger.restarted()
            agent.events.emit("restart", rank=slot.rank, life=slot.life)
            agent.restart_later(slot, then.delay_s)
        agent.wake()

    def _slots_left(self, slot: Slot) -> int | None:
        """How many of the job's slots can still run, ``slot`` now done for good: this
        agent's own count on one node; on several, the store's count of the job's slots
        gone (None if the store cannot say: no verdict then)."""
        agent = self.agent
        if agent.config.nnodes == 1:
            return sum(not s.done for s in agent.slots.values() if s is not slot)
        try:
            gone = int(agent.store.add(agent.keys.slots_gone, 1))
        except Exception:
            log.warning("could not count rank %d's slot as gone", slot.rank, exc_info=True)
            return None
        return agent.config.world_size - gone

    def count_fault(self, rank: int, what: str) -> None:
        """A fault of ``rank``'s slot (:mod:`fastft.launch.rules.offenders`); at the count of
        ``--quarantine`` it is quarantined. A live worker is then drained: it leaves at
        its next commit, and its exit takes the quarantine's way."""
        agent = self.agent
        with self._count_lock:
            why = agent.offenders.fault(rank, time.monotonic(), what)
        if why is None:
            return
        agent.events.emit("quarantined", rank=rank, reason=why)
        print(  # (one fastft: line, as every fault's)
            f"fastft: quarantine: {why} (--quarantine {agent.config.quarantine})",
            file=sys.stderr,
            flush=True,
        )
        slot = agent.slots[rank]
        if slot.proc is not None and slot.proc.returncode is None and not slot.done:
            agent.children.kill(slot, signal.SIGTERM, incarnation=slot.incarnation)

    def _restart_group(self, slot: Slot) -> None:
        """Take the rest of ``slot``'s shard group down with it: the group starts again as
        a whole, under its next generation (the prefix its members meet under)."""
        agent, k = self.agent, self.agent.config.shard_size
        lives = {r: s.incarnation for r, s in agent.slots.items() if s.incarnation and not s.done}
        mates = policy.group_mates(slot.rank, slot.incarnation, k, lives, agent.ledger.down)
        if mates is None:
            return
        group = slot.rank // k
        gen = agent.ledger.take_down(group, (lives[r] for r in mates))
        agent.events.emit(
            "group_restart",
            group=group,
            gen=gen,
            cause=slot.rank,
            ranks=[slot.rank, *mates],
        )
        for r in mates:
            agent.children.kill(agent.slots[r], incarnation=lives[r])

    def forget_joiner(self, slot: Slot) -> None:
        key = self.agent.keys.joiner(slot.rank)
        try:
            # Joiner keys are cleared, never deleted: a worker may be between its check
            # and its get of the key, and a get of a missing key blocks for the timeout.
            self.agent.store.compare_set(key, str(slot.incarnation), "")
        except Exception:
            log.debug("could not clear joiner key of rank %d", slot.rank, exc_info=True)

    def end_stopped(self) -> None:
        """torchft's baseline leaves a stopped worker stopped; once every other worker
        finished, end it so that the job ends."""
        live = [s for s in self.agent.slots.values() if not s.done]
        if live and all(s.hung == s.incarnation for s in live):
            for s in live:
                s.done = True
                self.agent.children.kill(s, incarnation=s.incarnation)


def _joined(slot: Slot) -> bool:
    """Whether the slot's worker started fastft (its runtime writes the heartbeat file)."""
    hb = read_heartbeat(slot.heartbeat)
    return hb is not None and hb.last >= slot.started


def fault_line(slot: Slot, code: int | None, sig: int | None, do: policy.AfterExit) -> str:
    """The agent's line for a worker's own failure: what, which rank and life, and what
    comes next."""
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        how = f"killed by {name}"
    else:
        how = f"exited with code {code}"
    if code in FASTFT_STATUSES and slot.ending is None:
        how += " (the script's own status: fastft's would come with its record)"
    if slot.declared[0] == slot.incarnation:
        how = f"{slot.declared[1]} ({how} by the agent)"
    elif slot.hung == slot.incarnation:
        how = f"hung ({how} by the agent)"
    elif slot.stopped == slot.incarnation:
        how = f"stopped ({how} by the agent)"
    if do.restart:
        nxt = f"restarting it as life {slot.life + 1}"
    elif do.shrink:
        nxt = "the world goes on without it"
    elif do.failed:
        nxt = "the job fails"
    else:
        nxt = "its slot is done"
    return f"fastft: fault: rank {slot.rank}.{slot.life} {how}; {nxt}"


def back_line(slot: Slot, now: float) -> str:
    """The agent's line once a restarted slot committed again."""
    return (
        f"fastft: rank {slot.rank}.{slot.life} is back: it committed a step "
        f"{now - slot.fault_at:.2f} s after its last life failed"
    )
