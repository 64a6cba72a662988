"""What the agent does when a worker exits or stops: report it on the bus once (the exit
trace and ``waitid`` may both see it), then restart the slot, mark it done or fail the job
(:func:`fastft.launch.policy.after_exit` decides). The agent's part for it, as
:class:`~fastft.runtime.engine.membership.Membership` is the executor's: it uses the agent's
state (``slots``, ``children``, ``spares``, ``events``, ``store``, ``keys``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import fastft.launch.policy as policy
from fastft.launch.children import Slot
from fastft.process.heartbeat import read_heartbeat
from fastft.protocol import EXIT_DRAINED, HangSuspected, ProcessExited
from fastft.protocol.exits import ENDS_THE_JOB, FASTFT_STATUSES, ending_path

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
        self.forget_joiner(slot)
        cfg = self.agent.config
        ours = slot.ending is not None  # (a status of fastft's, recorded: not the script's)
        own = (  # a failure of the worker itself, not an exit the agent caused (a stop,
            code != 0  # a failed job, a drain, a group, a fence)
            and not (code == EXIT_DRAINED and ours)
            and not slot.done
            and self.agent.stopping is None
            and self.agent.failed is None
            and self.agent.draining is None
            and not self.agent.ledger.taken_down(slot.incarnation)
            and not self.agent.ledger.fenced(slot.incarnation)
        )
        how = f"code {code}" if sig is None else f"signal {sig}"
        if code == 0 and cfg.torchft != "plain" and not _joined(slot):
            self.agent.events.emit("never_joined", rank=slot.rank, life=slot.life)
            print(
                f"fastft: WARNING: rank {slot.rank} exited 0 without calling fastft.init(): it "
                "never joined the job (a script under `fastft run` calls ft = fastft.init(), "
                "ft.register(model=..., optimizer=...) and runs its steps in "
                "`with ft.transaction():`)",
                file=sys.stderr,
                flush=True,
            )
        if own:
            self.count_fault(slot.rank, "hung" if slot.hung == slot.incarnation else how)
            slot.fault_at = time.monotonic()
        ledger = self.agent.ledger
        failed = own and slot.hung != slot.incarnation  # (hung: the hang timeout's)
        ended_first = slot.life == 0 and ledger.first_life_ended(
            slot.rank, failed=failed and not self.agent.committed(slot)
        )
        # (a status that names its own reason, a script error: the policy says it)
        if ended_first and ledger.startup_failed() and not (ours and code in ENDS_THE_JOB):
            slot.done = True
            self.agent.fail(
                f"every worker failed before its first commit (rank {slot.rank}: {how}); "
                "the script cannot start: its error is above"
            )
            return

        agent = self.agent
        finished = any(  # another slot's worker ended the job cleanly already
            s.done and s.proc is not None and s.proc.returncode == 0 for s in agent.slots.values()
        )
        do = policy.after_exit(
            rank=slot.rank,
            code=code,
            sig=sig,
            life=slot.life - slot.drains,
            max_restarts=cfg.max_restarts,
            stopping=agent.stopping is not None,
            already_done=slot.done,
            peers_finished=finished,
            spares_left=bool(self.agent.spares),
            elastic=cfg.min_replicas is not None and cfg.min_replicas < cfg.world_size,
            draining=self.agent.draining is not None,
            quarantined=self.agent.offenders.quarantined.get(slot.rank),
            ours=ours,
            replaced=agent.ledger.replaced(slot.incarnation),
        )
        ending = agent.stopping is not None or agent.draining is not None or agent.failed
        if do.done and not do.failed and code != 0 and not finished and not ending:
            # a slot done for good (drained, shrunk): can the others still form a world?
            left = self._slots_left(slot)
            lost = (
                None if left is None else policy.floor_lost(left, cfg.min_replicas, cfg.world_size)
            )
            if lost is not None:
                do = dataclasses.replace(do, failed=lost)
        if own:  # one line per fault in every log, a terminal or not
            print(fault_line(slot, code, sig, do), file=sys.stderr, flush=True)
        if do.failed:
            self.agent.fail(do.failed)
        if do.shrink:
            self.agent.events.emit("world_shrinks", rank=slot.rank, reason=do.shrink)
            log.warning("the world goes on without rank %d: %s", slot.rank, do.shrink)
        slot.spare_only = do.spare_only
        if do.done:
            slot.done = True
        if do.restart and cfg.shard_size > 1:
            self._restart_group(slot)
        if do.restart and (code == EXIT_DRAINED and ours or ledger.fenced(slot.incarnation)):
            # (a drain, or a fence of a node declared lost while its link was down, is no
            # failure of the worker: it uses up no restart; four flaps failed a job)
            slot.drains += 1
        if do.restart:
            slot.life += 1
            self.agent.ledger.restarted()
            self.agent.events.emit("restart", rank=slot.rank, life=slot.life)
            self.agent.restart_later(slot, do.delay_s)
        self.agent.wake()

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
        """A fault of ``rank``'s slot (:mod:`fastft.launch.offenders`); at the count of
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
