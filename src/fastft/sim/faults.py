"""The faults a simulated run injects, drawn from its seed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastft.sim.options import Options

__all__ = ["ALL_KINDS", "CORRUPT", "GRAY_KINDS", "KINDS", "Plan", "SimFault", "corruption"]

KINDS = (
    "kill",  # SIGKILL: the agent sees the exit
    "hang",  # SIGSTOP or a GIL hang: the agent's hang timeout kills it
    "exception",  # an exception in the step (Fault2)
    "escape",  # an exception after a step (an evaluation): ft.run restarts in process
    "state_lost",  # the state is gone but the process lives (Fault1)
    "drain",  # a drain request (a preemption notice)
    "msg_lost",  # the next message to the rank is lost
    "msg_dup",  # ... delivered twice
    "msg_delay",  # ... 200 ms late
    "store_fail",  # the next store call fails (whoever makes it)
    "partition",  # the rank's node is cut off (0.1 s: within its lease; 1 s: past it)
    "kill_at_formation",  # killed right after arriving at a formation
    "kill_at_heal",  # killed in the middle of a heal
)

GRAY_KINDS = (
    "slow",  # a straggler: its steps compute 3x as long; the agents name it and replace it
    "bitflip",  # its state is corrupted silently: the replica check (every step) repairs it
    "node_drain",  # a SIGTERM to the rank's node agent (a preemption): it drains its workers;
    # the node is replaced 0.5 s or 2 s later (its agent started again: new lives)
)
"""Drawn only when asked for (``kinds``): the default draws stay those of the regression
seeds."""
ALL_KINDS = KINDS + GRAY_KINDS
CORRUPT = "~"
"""The mark a ``bitflip`` leaves in a life's state hash, before the flip's own id: it
stays through the life's commits, and no two flips corrupt alike."""


def corruption(h: str) -> str | None:
    """The id of the flip that corrupted state ``h`` (None: not corrupted)."""
    _, sep, mark = h.partition(CORRUPT)
    return mark if sep else None


@dataclass
class SimFault:
    kind: str
    rank: int
    t: float
    duration: float = 0.0
    used: bool = False

    @property
    def point(self) -> str | None:
        """A fault at a point of the protocol instead of a time (after ``t``)."""
        return {"kill_at_formation": "formation", "kill_at_heal": "heal"}.get(self.kind)


@dataclass
class Plan:
    faults: list[SimFault] = field(default_factory=list)

    @classmethod
    def draw(cls, rng: random.Random, opts: Options) -> Plan:
        kinds = opts.kinds or KINDS
        out = []
        for _ in range(rng.randint(0, opts.faults)):
            kind = rng.choice(kinds)
            rank = rng.randrange(opts.world_size)
            t = rng.uniform(0.0, 0.05 + 0.02 * opts.steps)
            duration = rng.choice((0.1, 1.0)) if kind == "partition" else 0.0
            if kind == "node_drain":  # (the scheduler starts the node's agent again)
                duration = rng.choice((0.5, 2.0))
            out.append(SimFault(kind, rank, t, duration))
        return cls(out)

    def describe(self) -> str:
        if not self.faults:
            return "no faults"
        return ", ".join(
            f"{f.kind} rank {f.rank} at {f.t * 1e3:.1f} ms"
            + (f" for {f.duration:g} s" if f.duration else "")
            for f in self.faults
        )
