"""Several workers' executors in one process, on fakes: an in-memory store, the memory bus,
a fake clock for the coordinator, and an in-process data plane (a heal copies the
source's packed state). The state machine, the inbox, the formation, the coordinator and
the executor are the real ones; only process groups, signals and processes are not.

Each scenario drives 3-4 members through faults and joins and checks:

* S2: one decision per (epoch, step), and every member that lived through it applied it;
* S3: after each commit every member holds the same state (the digest of step s is a
  function of s alone here: every step's gradient is a function of the step);
* S4: a member votes for step s only holding the committed state of step s (checked at
  every vote against that digest);
* every member ends at the last step with the fault-free run's state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from fastft.fsm import GradsReady, Phase
from fastft.inject import FaultPlan, Injector
from fastft.interrupt import Interrupter
from fastft.process.events import EventLog
from fastft.process.heartbeat import HeartbeatWriter
from fastft.process.services import Services
from fastft.protocol import JobKeys, ProcessExited, Role
from fastft.runtime.contract import EpochView, Member, RuntimeConfig
from fastft.runtime.endings import JobFinished, WorkerExit
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.executor import EngineParts, Executor
from fastft.runtime.engine.sideclient import SideClient
from fastft.runtime.state.heal import HealResult
from fastft.runtime.state.kept import KeptGradients
from fastft.runtime.state.registry import StateRegistry
from fastft.testing import FakeClock, MemoryBus, MemoryHub, MemoryStore
from fastft.testing.engine import FakePlane

pytestmark = pytest.mark.timeout(60)

JOB = "sim"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _grads(model: nn.Module, step: int) -> None:
    """The step's (already reduced) gradient: a function of the step alone."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.01 * ((step * 7 + i) % 5 - 2))


def canonical_digests(steps: int) -> list[str]:
    model, opt = _model()
    reg = StateRegistry()
    reg.register(model, opt)
    out = [reg.digest(0)]
    for s in range(steps):
        _grads(model, s)
        opt.step()
        reg.zero_grads()
        out.append(reg.digest(s + 1))
    return out


class _FakeHealer:
    """A heal in one process: the receiver loads what the source packs."""

    def __init__(self, world: World, me: Sim) -> None:
        self.world = world
        self.me = me

    def transfer(self, epoch: int, step: int, view: EpochView, rank: int, fetch: bool) -> Any:
        receiving = fetch or rank in view.needs_state
        if receiving and rank != view.source:
            src = self.world.live_member(view.source, view.incarnation(view.source))
            if src is None:
                raise RuntimeError(f"heal source rank {view.source} is gone")
            header, flats = src.registry.pack(view.step)
            self.me.registry.load_packed(header, [f.clone() for f in flats])
            self.me.healed.append((epoch, view.step))
        return HealResult(receiving, None)


class _RecordingCoordinator(Coordinator):
    """Checks S4 at every vote: the voter holds the committed state of the step."""

    sim: Sim

    def vote(self, epoch: int, step: int, n_members: int, **kw: Any) -> str | None:
        got = self.sim.registry.digest(step)
        want = self.sim.world.digests[step]
        self.sim.world.votes.append((self.sim.rank, self.sim.inc, epoch, step, got == want))
        return super().vote(epoch, step, n_members, **kw)


@dataclass
class Sim:
    """One life of one worker: an executor and the thread that runs its steps."""

    world: World
    rank: int
    inc: int
    die_at: int | None = None
    fail_at: int | None = None
    registry: StateRegistry = field(default_factory=StateRegistry)
    healed: list[tuple[int, int]] = field(default_factory=list)
    applied: dict[tuple[int, int], str] = field(default_factory=dict)
    error: BaseException | None = None
    dead: bool = False
    ended_unadmitted: bool = False
    """It waited to join until the job finished (never a member)."""

    def start(self) -> None:
        w = self.world
        cfg = RuntimeConfig(
            store="mem:0",
            job=JOB,
            rank=self.rank,
            world_size=w.size,
            min_replicas=w.min_replicas,
            incarnation=self.inc,
            keep_gradients=False,
        )
        keys = JobKeys(JOB)
        coord = _RecordingCoordinator(
            w.store.clone(),
            keys,
            self.rank,
            self.inc,
            w.size,
            cfg.min_members,
            clock=w.clock,
            sleep=w.sleep,
            decision_store=_short(w.store.clone()),
        )
        coord.sim = self
        self.model, self.opt = _model()
        self.registry.register(self.model, self.opt)
        events = EventLog(None, f"rank {self.rank}")
        dead: set[Member] = set()
        coord.dead = dead
        parts = EngineParts(
            coord,
            SideClient(w.store.clone(), keys),
            self.registry,
            Interrupter(),  # not installed: no signals, the state machine still interrupts
            events,
            FakePlane(),
            KeptGradients(False),
        )
        x = self.x = Executor(cfg, Member(self.rank, self.inc), parts, dead)
        self.bus = MemoryBus(w.hub, job=JOB, rank=self.rank, incarnation=self.inc)
        self.bus.subscribe(x.faults.on_message)
        sv = Services(
            events, HeartbeatWriter(None), self.bus, Injector(FaultPlan(()), self.rank, 0)
        )
        x.attach(sv)
        x.healer = _FakeHealer(w, self)  # type: ignore[assignment]
        self.bus.start()
        self.thread = threading.Thread(target=self._run, name=f"sim-{self.rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        x = self.x
        try:
            x.drive(lambda s: s.phase is Phase.NORMAL)
            while x.state.step < self.world.steps:
                x.drive(lambda s: s.phase is Phase.NORMAL)
                step = x.state.step
                if step >= self.world.steps:
                    break
                if step == self.die_at:
                    self.die_at = None
                    self.world.kill(self)
                    return
                if self.world.step_s:
                    time.sleep(self.world.step_s)
                _grads(self.model, step)
                if step == self.fail_at:
                    self.fail_at = None
                    x.faults.local(RuntimeError("injected"), gen=x.phase_changes)
                    continue
                with x.lock:
                    if x.state.phase is Phase.NORMAL and x.state.step == step:
                        x.feed_locked(GradsReady())
                x.drive(
                    lambda s, step=step: (
                        s.step != step or s.phase not in (Phase.PREPARED, Phase.COMMIT)
                    )
                )
                if x.state.step > step:
                    self.applied[(x.state.epoch, step)] = self.registry.digest(step + 1)
            # a member's end marks the job finished (Runtime.close): a worker still waiting
            # to join then ends too (an elastic world may finish before its restart joins)
            self.world.store.set(JobKeys(JOB).finished, str(x.state.step))
        except JobFinished:
            self.ended_unadmitted = self.x.view is None
        except WorkerExit:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def close(self) -> None:
        self.x.closing = True
        self.x.membership.collector.close()
        self.bus.close()


def _short(store: MemoryStore) -> MemoryStore:
    import datetime

    store.set_timeout(datetime.timedelta(seconds=0.2))
    return store


class World:
    """The job: its store, bus and members; the agent's part (exits, restarts) too."""

    def __init__(
        self, size: int, steps: int, min_replicas: int | None = None, step_s: float = 0.0
    ) -> None:
        self.size = size
        self.steps = steps
        self.step_s = step_s
        """Each step's compute time (real seconds)."""
        self.min_replicas = min_replicas
        self.store = MemoryStore(timeout_s=5)
        self.hub = MemoryHub()
        self.clock = FakeClock(1000.0)
        self.digests = canonical_digests(steps)
        self.votes: list[tuple[int, int, int, int, bool]] = []
        self.lives: list[Sim] = []
        self._next_inc = 100
        self._lock = threading.Lock()
        self.agent = MemoryBus(self.hub, job=JOB, rank=-1, incarnation=1, role=Role.AGENT)
        self.agent.start()
        self.restart_dead = True

    def sleep(self, s: float) -> None:
        self.clock.advance(s)
        threading.Event().wait(0.0005)

    def spawn(self, rank: int, **kw: Any) -> Sim:
        with self._lock:
            self._next_inc += 1
            sim = Sim(self, rank, self._next_inc, **kw)
            self.lives.append(sim)
        sim.start()
        return sim

    def live_member(self, rank: int, inc: int) -> Sim | None:
        for s in self.lives:
            if s.rank == rank and s.inc == inc and not s.dead:
                return s
        return None

    def kill(self, sim: Sim) -> None:
        """The life ends at once (its thread returns); its agent tells the job, and
        restarts the slot as a new life."""
        sim.dead = True
        sim.bus.close()
        self.agent.broadcast(
            ProcessExited(
                job=JOB,
                epoch=0,
                rank=-1,
                incarnation=1,
                role=Role.AGENT,
                exited_rank=sim.rank,
                exited_incarnation=sim.inc,
                exit_code=None,
                signal=9,
            )
        )
        # joiner keys of a dead life are cleared by its agent
        self.store.compare_set(JobKeys(JOB).joiner(sim.rank), str(sim.inc), "")
        if self.restart_dead:
            threading.Thread(target=self.spawn, args=(sim.rank,), daemon=True).start()

    def run(self, plan: dict[int, dict[str, int]], timeout_s: float = 40.0) -> None:
        for r in range(self.size):
            self.spawn(r, **plan.get(r, {}))
        deadline = threading.Event()
        waited = 0.0
        while waited < timeout_s:
            live = [s for s in self.lives if not s.dead]
            if (
                live
                and all(not s.thread.is_alive() for s in live)
                and len(live) >= (self.min_replicas or self.size)
            ):
                break
            deadline.wait(0.05)
            waited += 0.05
        for s in self.lives:
            if not s.dead:
                s.x.closing = True
        for s in self.lives:
            s.thread.join(timeout=5)
            s.close()
        self.agent.close()
        errors = [s.error for s in self.lives if s.error is not None]
        assert not errors, errors
        assert waited < timeout_s, "the simulated job did not finish"

    def check(self) -> None:
        # S4: every vote was cast holding the committed state of its step
        bad = [v for v in self.votes if not v[4]]
        assert not bad, f"votes without the committed state: {bad}"
        # S2 + S3: per (epoch, step), every life that applied it holds the same state, the
        # fault-free run's
        for s in self.lives:
            for (_, step), d in s.applied.items():
                assert d == self.digests[step + 1], (s.rank, s.inc, step)
        # every live member ended at the last step with the fault-free state
        final = [s for s in self.lives if not s.dead and not s.ended_unadmitted]
        assert len(final) >= (self.min_replicas or self.size)
        for s in final:
            assert s.x.state.step == self.steps, (s.rank, s.x.state)
            assert s.registry.digest(self.steps) == self.digests[self.steps]


def _decisions(world: World) -> dict[tuple[int, int], set[str]]:
    out: dict[tuple[int, int], set[str]] = {}
    for s in world.lives:
        for key in s.applied:
            out.setdefault(key, set()).add("commit")
    return out


@pytest.mark.parametrize("size", [3, 4])
def test_fault_free(size: int) -> None:
    w = World(size, steps=8)
    w.run({})
    w.check()
    assert {r for r, *_ in w.votes} == set(range(size))


def test_an_exception_rolls_the_step_back_on_every_member() -> None:
    w = World(3, steps=8)
    w.run({1: {"fail_at": 3}})
    w.check()
    assert all(len(s.applied) == 8 for s in w.lives)  # nobody lost a step


@pytest.mark.parametrize("rank", [0, 2])
def test_a_dead_member_is_replaced_and_heals_before_it_votes(rank: int) -> None:
    w = World(3, steps=10)
    w.run({rank: {"die_at": 4}})
    w.check()
    lives = [s for s in w.lives if s.rank == rank]
    assert len(lives) == 2 and lives[0].dead
    assert lives[1].healed, "the new life voted without a heal"


def test_two_deaths_in_one_fixed_world() -> None:
    w = World(4, steps=12)
    w.run({1: {"die_at": 3}, 3: {"die_at": 7}})
    w.check()


def test_an_elastic_world_goes_on_without_the_dead_and_readmits_it() -> None:
    # (steps that take time: with none the survivors could finish before the restart joins)
    w = World(3, steps=12, min_replicas=2, step_s=0.05)
    w.run({2: {"die_at": 4}})
    w.check()
    assert any(s.rank == 2 and not s.dead and s.healed for s in w.lives)


def test_every_decision_is_applied_alike() -> None:
    w = World(3, steps=10)
    w.run({0: {"fail_at": 2}, 1: {"die_at": 5}})
    w.check()
    for key, outcomes in _decisions(w).items():
        assert outcomes == {"commit"}, key


def test_an_elastic_world_below_min_replicas_says_so_and_waits() -> None:
    w = World(3, steps=12, min_replicas=2)
    w.restart_dead = False  # restarted below, once both are dead and rank 0 had to wait

    def restart_late() -> None:
        while sum(s.dead for s in w.lives) < 2:
            time.sleep(0.01)
        time.sleep(0.3)
        for rank in (1, 2):
            w.spawn(rank)

    threading.Thread(target=restart_late, daemon=True).start()
    w.run({1: {"die_at": 4}, 2: {"die_at": 4}})
    w.check()
    (first,) = [s for s in w.lives if s.rank == 0]
    assert first.x.membership._below is not None  # event below_min_replicas, and a warning
    _, have, need = first.x.membership._below
    assert (have, need) == (1, 2)
