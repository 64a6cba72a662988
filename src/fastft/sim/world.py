"""The simulated job: one thread, simulated time, a seeded scheduler.

The world holds the store (:class:`~fastft.sim.store.SimStore`), the bus (a queue of
deliveries with delays), the members' lives (:class:`~fastft.sim.life.Life`), the node
agents (exit notices, restarts, hang and node-loss verdicts, with the real
:func:`fastft.launch.rules.policy.after_exit`) and the faults. Every event comes off one heap in
time order; ties and every delay are drawn from ``random.Random(seed)``, so a seed is a
run, bit for bit. :class:`~fastft.sim.checks.Checks` holds the invariants.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from dataclasses import dataclass, field
from typing import Any

from fastft.launch.gray.stragglers import StragglerWatch
from fastft.launch.rules.offenders import Offenders, QuarantineRule
from fastft.protocol import (
    DrainRequest,
    Fault,
    JobKeys,
    Message,
    Severity,
)
from fastft.protocol.exits import EXIT_DRAINED
from fastft.runtime.contract import Member
from fastft.runtime.engine.formation import Recovery
from fastft.sim.agents import JUDGED_AFTER_S, STRAGGLER_CHECK_S, Agents, Slot
from fastft.sim.checks import Checks
from fastft.sim.faults import CORRUPT, Plan, SimFault
from fastft.sim.life import Ended, Life
from fastft.sim.options import Options
from fastft.sim.store import SimStore, StoreDown

__all__ = ["Options", "World"]


@dataclass(order=True)
class _Ev:
    t: float
    seq: int
    kind: str = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)


class World(Agents):
    def __init__(self, opts: Options, seed: int, *, plan: Plan | None = None, trace: bool = False):
        self.opts = opts
        self.seed = seed
        self.rng: random.Random | None = random.Random(seed)
        self.now = 0.0
        self.queue: list[_Ev] = []
        self._seq = 0
        self.store = SimStore()
        self.keys = JobKeys("sim")
        self.chain = [hashlib.sha1(b"seed").hexdigest()[:12]]
        for s in range(opts.steps):
            self.chain.append(self.next_hash(self.chain[-1], s))
        self.lives: dict[Member, Life] = {}
        self.slots = {r: Slot(r) for r in range(opts.world_size)}
        self.collectives: dict[tuple[int, int], set[Member]] = {}
        self.completed: dict[tuple[int, int], set[Member]] = {}
        """Who completed each step's collective (the others may still fail it)."""
        self.flagged: set[tuple[int, int]] = set()
        """Steps whose collective carried a drain or a join flag (no agreed decision)."""
        self.snapshots: dict[tuple[int, int], dict[Member, str]] = {}
        """The state each member reached each step's collective with (the replica check)."""
        self.known_corrupt: set[str] = set()
        """The flips the replica check found (a state they corrupted never serves a heal
        nor votes after)."""
        self.stragglers = StragglerWatch()
        self.replacing: set[Member] = set()
        self.offenders = Offenders(QuarantineRule.parse(opts.quarantine))
        nodes = -(-opts.world_size // opts.per_node)
        self.spares = dict.fromkeys(range(nodes), opts.warm_spares)
        """Each node's ready warm spares."""
        self.spare_starts = 0
        """Lives started on a warm spare."""
        self.owed: list[tuple[Member, float]] = []
        """Spares handed out (the life each became, the refill's deadline)."""
        self.draining: set[int] = set()
        """Nodes whose agent drains its workers."""
        """Lives drained as stragglers (their exit restarts the slot, elastic too)."""
        self.pg_arrivals: dict[int, set[Member]] = {}
        self.heal_arrivals: dict[int, set[Member]] = {}
        self.built: dict[Member, int] = {}
        self.checkpoints: dict[int, str] = {}
        self.outcome: str | None = None
        self.checks = Checks(self)
        self.tracing = trace
        self.lines: list[str] = []
        self.events = 0
        self.plan = plan if plan is not None else Plan.draw(self.rng, opts)
        self._next_inc = 0
        self.msg_faults: list[SimFault] = []
        self.partitioned: set[int] = set()
        self.fixed = False
        """Every delay its nominal value (the exhaustive explorer's timing)."""

    # --- time and events ----------------------------------------------------------------
    def at(self, delay: float, kind: str, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self.queue, _Ev(self.now + max(delay, 0.0), self._seq, kind, args))

    def draw(self, lo: float, hi: float) -> float:
        """A delay between ``lo`` and ``hi``: drawn from the seed, or their middle in the
        exhaustive explorer's fixed timing."""
        if self.fixed or self.rng is None:
            return (lo + hi) / 2
        return self.rng.uniform(lo, hi)

    def __getstate__(self) -> dict[str, Any]:
        """A fixed-timing run draws nothing: its copies leave the generator out (half of a
        copy's bytes, the explorer's main cost)."""
        state = self.__dict__.copy()
        if self.fixed:
            state["rng"] = None
        return state

    def jitter(self, s: float) -> float:
        return s * self.draw(0.5, 1.5)

    def compute_s(self) -> float:
        return self.draw(0.005, 0.015)

    def trace(self, who: Any, what: str) -> None:
        if self.tracing:
            self.lines.append(f"{self.now * 1e3:10.3f} ms  {who}: {what}")

    def violation(self, what: str) -> None:
        self.checks.fail(what)

    @staticmethod
    def next_hash(h: str, step: int) -> str:
        """The state after ``step``: a function of the state before it and the step's batch."""
        return hashlib.sha1(f"{h}|{step}|batch{step}".encode()).hexdigest()[:12]

    def recovery(self) -> Recovery:
        newest = max(self.checkpoints) if self.checkpoints else None
        return Recovery(newest, self.opts.allow_fresh_start)

    def begin(self) -> None:
        for r in range(self.opts.world_size):
            self.at(self.draw(0, 0.05), "spawn", r)
        for i, f in enumerate(self.plan.faults):
            self.at(f.t, "fault", i)

    def run(self) -> World:
        self.begin()
        while not self.ended():
            self.step(0)
        return self

    def ended(self) -> bool:
        """The run is over: the job ended, a check failed, or nothing is left to happen
        (then a liveness failure)."""
        if self.outcome is not None or self.checks.failed:
            return True
        if not self.queue:
            self.violation("nothing is left to happen and the job has not ended")
            return True
        return False

    def step(self, i: int) -> str:
        """Run the event ``i`` of :meth:`due` (0: the earliest); what it was."""
        ev = heapq.heappop(self.queue) if i == 0 else self._take(i)
        self.now = max(self.now, ev.t)
        self.events += 1
        getattr(self, "_on_" + ev.kind)(*ev.args)
        self.checks.progress()
        if self.now > self.opts.horizon_s:
            self.violation(f"the job neither finished nor failed in {self.opts.horizon_s} s")
        if self.outcome is not None and not self.checks.failed:
            self.checks.at_end()
        return f"{ev.kind} {ev.args[0] if ev.args else ''}"

    def due(self, window_s: float) -> list[int]:
        """The events that may run next: each due within ``window_s`` of the earliest
        (indices for :meth:`step`), the stale polls of a life left out."""
        self.queue = [ev for ev in self.queue if not self.stale(ev)]  # (no-ops)
        heapq.heapify(self.queue)
        if not self.queue:
            return []
        evs = sorted(self.queue)
        first = evs[0].t
        out, heads = [], set()
        for i, ev in enumerate(evs):
            if ev.t > first + window_s:
                break
            if ev.kind == "deliver":  # one queue per subscriber (TCPStore's bus): in order
                if ev.args[0] in heads:
                    continue
                heads.add(ev.args[0])
            out.append(i)
        return out

    def stale(self, ev: _Ev) -> bool:
        if ev.kind != "main":
            return False
        life = self.lives[ev.args[0]]
        return ev.args[1] != life.main_token or not life.alive

    def inject(self, i: int) -> None:
        """The planned fault ``i``, now."""
        self._on_fault(i)
        self.checks.progress()

    def alive_ranks(self) -> list[int]:
        return [r for r, s in sorted(self.slots.items()) if s.life and self.lives[s.life].alive]

    def _take(self, i: int) -> _Ev:
        ev = sorted(self.queue)[i]
        self.queue.remove(ev)
        heapq.heapify(self.queue)
        return ev

    # --- lives --------------------------------------------------------------------------
    def wake(self, life: Life) -> None:
        """An event was fed: a main thread waiting in drive looks now (the condition)."""
        if life.pc[0] == "drive" and life.alive:
            self.schedule_main(life, 0.00005)

    def schedule_main(self, life: Life, delay: float) -> None:
        life.main_token += 1
        self.at(self.jitter(delay) if delay else 0.0, "main", life.me, life.main_token)

    def _on_spawn(self, rank: int, spare: bool = False) -> None:
        slot = self.slots[rank]
        if slot.done or self.outcome is not None:
            return
        if rank // self.opts.per_node in self.draining:
            slot.done = True  # (no new lives once the node drains)
            self.all_done()
            return
        self._next_inc += 1
        life = Life(self, rank, self._next_inc)
        self.lives[life.me] = life
        slot.life, slot.lives = life.me, slot.lives + 1
        if spare:
            self.owe(life.me)
        self.trace(life, "started")
        self.schedule_main(life, 0.0)

    def _on_main(self, who: Member, token: int) -> None:
        life = self.lives[who]
        if not life.alive or life.frozen or token != life.main_token:
            return
        try:
            delay = life.slice()
        except Ended as e:
            self.end_life(life, e.code, None, e.why)
            return
        except StoreDown as e:  # an exception on the main thread: the script ends
            self.end_life(life, 1, None, str(e))
            return
        if life.alive:
            self.schedule_main(life, delay)

    def end_life(
        self, life: Life, code: int | None, sig: int | None, why: str, by: str = ""
    ) -> None:
        """``life`` ends with ``code`` or ``sig``; ``by``: its agent killed it as ``hung``
        or ``fenced`` (an exit the agent caused)."""
        if not life.alive:
            return
        life.alive, life.ended_by = False, by
        if code == EXIT_DRAINED:
            self.checks.drained(life)
        self.trace(life, f"exits ({why}; code {code}, signal {sig})")
        self.at(0.0005, "exit_seen", life.me, code, sig)

    def finish(self, life: Life) -> None:
        """:meth:`fastft.runtime.api.Runtime.close` of a script that ended."""
        self.checks.finished(life)
        view = life.view
        if (
            life.state.may_end_the_job
            and view is not None
            and view.has(life.me.rank, life.me.incarnation)
        ):
            self.store.set(self.keys.finished, str(life.state.step))

    def after_commit(self, life: Life, step: int) -> None:
        self.checks.committed(life, step)
        every = self.opts.checkpoint_every
        view = life.view
        if every and (step + 1) % every == 0 and view is not None and view.members[0] == life.me:
            self.checkpoints[step + 1] = life.h

    def fire_due(self, life: Life, point: str) -> None:
        """A planned fault at a point of the protocol: a death after arriving at a
        formation, or while healing."""
        for f in self.plan.faults:
            if f.point == point and not f.used and f.rank == life.rank and self.now >= f.t:
                f.used = True
                self.trace(life, f"fault: killed at the {point}")
                self.end_life(life, None, 9, f"killed at the {point}")
                return

    # --- the bus ------------------------------------------------------------------------
    def broadcast(self, sender: Life | None, m: Message) -> None:
        if sender is not None and (sender.frozen or not sender.alive):
            return
        self.trace(sender or "agent", f"sends {type(m).__name__}")
        targets: list[Any] = [life for life in self.lives.values() if life.alive]
        if isinstance(m, Fault) and m.severity is Severity.FAULT1:  # (all agents act on)
            targets += [("agent", r) for r in sorted(self.slots)]
        for t in targets:
            if t is sender:
                continue
            delay = self.draw(0.0002, 0.002)
            copies = 1
            for f in self.msg_faults:
                if f.used or not isinstance(t, Life) or t.rank != f.rank:
                    continue
                f.used = True
                if f.kind == "msg_lost":
                    copies = 0
                elif f.kind == "msg_dup":
                    copies = 2
                else:
                    delay += 0.2
            for _ in range(copies):
                who = t.me if isinstance(t, Life) else t
                self.at(delay, "deliver", who, m)

    def _on_deliver(self, who: Any, m: Message) -> None:
        if isinstance(who, tuple):
            self.agent_message(who[1], m)
            return
        life = self.lives[who]
        if not life.alive:
            return
        try:
            life.on_message(m)
        except StoreDown as e:  # the bus endpoint logs and counts a callback that raises
            self.trace(life, f"listener callback raised: {e}")

    # --- faults -------------------------------------------------------------------------
    def _on_fault(self, i: int) -> None:
        f = self.plan.faults[i]
        slot = self.slots[f.rank]
        life = self.lives.get(slot.life) if slot.life is not None else None
        self.checks.fault_at(self.now)
        if f.point or life is None or not life.alive:
            return
        self.trace(life, f"fault: {f.kind}")
        if f.kind == "kill":
            self.end_life(life, None, 9, "SIGKILL")
        elif f.kind == "hang":
            life.freeze()
            self.at(self.opts.hang_timeout_s + JUDGED_AFTER_S, "hang_seen", life.me)
        elif f.kind in ("exception", "state_lost", "escape"):
            life.fail_next = f.kind
        elif f.kind == "drain":
            self.broadcast(None, DrainRequest(**self.agent_header(f.rank), target_rank=f.rank))
        elif f.kind in ("msg_lost", "msg_dup", "msg_delay"):
            self.msg_faults.append(f)
        elif f.kind == "store_fail":
            self.store.fail_next += 1
        elif f.kind == "slow":  # (the agents compare the members' compute: agents.py)
            life.slow = 3.0
            self.at(STRAGGLER_CHECK_S, "straggler_check")
        elif f.kind == "bitflip":  # silent: its next replica check finds it
            life.h += f"{CORRUPT}{life.me}@{self.now:.6f}"
        elif f.kind == "node_drain":
            self.node_drain(f.rank // self.opts.per_node, f.duration)
        elif f.kind == "partition":
            self.partition(f.rank // self.opts.per_node, f.duration)
