"""A deterministic simulator of fastft's protocol: N members, their agents and the control
plane in one thread, on simulated time, with the real deciders (see ``docs/simulation.md``).

``World(Options(...), seed).run()`` runs one seed; :mod:`fastft.sim.explore` runs many and
checks small worlds exhaustively; ``fastft sim`` is the command line."""

from fastft.sim.faults import ALL_KINDS, KINDS, Plan, SimFault
from fastft.sim.options import Options
from fastft.sim.world import World

__all__ = ["ALL_KINDS", "KINDS", "Options", "Plan", "SimFault", "World"]
