"""Many seeds, and every interleaving of a small world.

:func:`seeds` runs seeds one after another (within a time budget) and returns the ones that
failed. :func:`exhaustive` explores a small world depth first: the simulated time is fixed
(every delay its nominal value), and at every event the explorer branches over each event
due within ``window_s`` of the earliest (the events that may run first: messages overtake
each other, a poll reads before or after a write) and over each fault it may still inject
into each live member; states already seen (hashed, with times taken relative to the
present) are not explored again.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from fastft.runtime.engine.formation import JoinerWait, SurvivorWait
from fastft.sim.faults import Plan, SimFault
from fastft.sim.options import Options
from fastft.sim.world import World

__all__ = ["Exhaustive", "SeedReport", "exhaustive", "replay", "seeds"]


@dataclass
class SeedReport:
    ran: int = 0
    seconds: float = 0.0
    events: int = 0
    failed: dict[int, str] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return self.ran / self.seconds if self.seconds else 0.0


def seeds(
    opts: Options,
    which: Iterable[int],
    budget_s: float = float("inf"),
    *,
    until_failed: bool = False,
) -> SeedReport:
    """Run each seed of ``which`` until ``budget_s`` is spent (or, ``until_failed``, one
    fails)."""
    rep = SeedReport()
    t0 = time.monotonic()
    for seed in which:
        if time.monotonic() - t0 > budget_s or (until_failed and rep.failed):
            break
        w = World(opts, seed).run()
        rep.ran += 1
        rep.events += w.events
        kind = (w.outcome or "none").split(":")[0]
        rep.outcomes[kind] = rep.outcomes.get(kind, 0) + 1
        if w.checks.failures:
            rep.failed[seed] = w.checks.failures[0]
    rep.seconds = time.monotonic() - t0
    return rep


def replay(opts: Options, seed: int, plan: Plan | None = None) -> World:
    """One seed again, with its trace."""
    return World(opts, seed, plan=plan, trace=True).run()


# --- exhaustive --------------------------------------------------------------------------

EXHAUSTIVE_KINDS = ("kill", "exception", "state_lost", "drain")


@dataclass
class Exhaustive:
    states: int = 0
    """Distinct states at branch points."""
    events: int = 0
    runs: int = 0
    pruned: int = 0
    seconds: float = 0.0
    complete: bool = True
    failure: str | None = None
    choices: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    """The failing run's trace (``exhaustive(..., trace=True)``)."""


def fixed(opts: Options) -> Options:
    """The small world's timing: short timeouts, so that a wait ends in a few polls."""
    return replace(
        opts,
        faults=0,
        rollback_timeout_s=0.02,
        hang_timeout_s=0.02,
        restart_s=(0.01, 0.01),
        regroup_timeout_s=0.05,
        start_timeout_s=0.1,
        liveness_s=2.0,
        horizon_s=10.0,
    )


def exhaustive(
    opts: Options,
    *,
    faults: int = 1,
    kinds: tuple[str, ...] = EXHAUSTIVE_KINDS,
    window_s: float = 0.0,
    budget_s: float = float("inf"),
    trace: bool = False,
) -> Exhaustive:
    """Explore every order of the events due within ``window_s`` of each other (0: those
    due at the same time) and every placement of up to ``faults`` faults of ``kinds``, at
    any event and into any live member, in the world of ``opts`` (see the module). A run
    is copied only where it branches; states seen before (at branch points) are pruned."""
    rep = Exhaustive()
    t0 = time.monotonic()
    start = World(fixed(opts), 0, plan=Plan([]), trace=trace)
    start.fixed = True
    start.begin()
    seen: set[bytes] = set()
    stack: list[tuple[World, int, list[str]]] = [(start, faults, [])]
    while stack:
        w, left, path = stack.pop()
        while True:  # run on while the run does not branch
            if time.monotonic() - t0 > budget_s:
                rep.complete = False
                stack.clear()
                break
            if w.ended():
                rep.runs += 1
                if w.checks.failures:
                    rep.failure, rep.choices, rep.trace = w.checks.failures[0], path, w.lines
                    stack.clear()
                break
            due = w.due(window_s)
            ranks = w.alive_ranks() if left else []
            if len(due) == 1 and not ranks:
                w.step(due[0])
                rep.events += 1
                continue
            key = fingerprint(w, left)
            if key in seen:
                rep.pruned += 1
                break
            seen.add(key)
            rep.states += 1
            here = _freeze(w)  # one copy taken, each branch a thaw of it
            for rank in ranks:
                for kind in kinds:
                    nxt = _thaw(here)
                    nxt.plan.faults.append(SimFault(kind, rank, nxt.now))
                    nxt.inject(len(nxt.plan.faults) - 1)
                    stack.append((nxt, left - 1, [*path, f"{kind} rank {rank} at {w.now:.4f}"]))
            for i in due[1:]:
                nxt = _thaw(here)
                stack.append((nxt, left, [*path, f"{nxt.step(i)} first"]))
            w.step(due[0])
            rep.events += 1
    rep.seconds = time.monotonic() - t0
    return rep


def _freeze(w: World) -> bytes:
    """A run's copy (pickle: 2.7x faster than deepcopy here), taken once per branch point."""
    return pickle.dumps(w, protocol=pickle.HIGHEST_PROTOCOL)


def _thaw(frozen: bytes) -> World:
    return pickle.loads(frozen)  # noqa: S301


def _rel(w: World, v: object) -> object:
    """A value with its times taken relative to the present (waits hold absolute ones)."""
    if isinstance(v, float):
        return round(v - w.now, 5)
    if isinstance(v, SurvivorWait):
        return (v.prev, tuple(v.expected), v.step, v.lost_state, v.admit, _rel(w, v.deadline))
    if isinstance(v, JoinerWait):
        return (_rel(w, v.started), v.seen)
    return v


def fingerprint(w: World, left: int) -> bytes:
    """The state of a run, up to the present time: equal fingerprints, equal futures (the
    explorer's approximation: times within 10 µs are one)."""
    lives: list[tuple[object, ...]] = []
    for m, life in sorted(w.lives.items()):
        if not life.alive:
            lives.append((m, False))
            continue
        lives.append(
            (
                m,
                life.frozen,
                life.state,
                life.view,
                tuple(life.todo),
                tuple(_rel(w, v) for v in life.pc),
                life.user,
                life.h,
                life.held,
                tuple(sorted(life.dead)),
                life.interrupts != getattr(life, "interrupts_at", life.interrupts),
                life.recoveries,
                life.fail_next,
                _rel(w, life.phase_since),
                tuple(life.buffered),
            )
        )
    events = sorted(
        (round(ev.t - w.now, 5), ev.kind, repr(ev.args[:1] if ev.kind == "main" else ev.args))
        for ev in w.queue
        if not w.stale(ev)
    )
    state = (
        left,
        w.outcome,
        sorted(w.store.kv.items()),
        sorted(w.checkpoints.items()),
        lives,
        [(r, s.life, s.done, s.finished) for r, s in sorted(w.slots.items())],
        events,
        sorted((k, tuple(sorted(v))) for k, v in w.collectives.items()),
        sorted((k, tuple(sorted(v))) for k, v in w.completed.items()),
        sorted(w.flagged),
        sorted((k, tuple(sorted(v))) for k, v in w.pg_arrivals.items()),
        sorted((k, tuple(sorted(v))) for k, v in w.heal_arrivals.items()),
        sorted(w.built.items()),
    )
    return hashlib.blake2b(repr(state).encode(), digest_size=16).digest()


def digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
