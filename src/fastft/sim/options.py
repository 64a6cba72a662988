"""The options of one simulated job."""

from __future__ import annotations

from dataclasses import dataclass

from fastft.runtime.contract import REGROUP_TIMEOUT_S

__all__ = ["Options"]


@dataclass(frozen=True)
class Options:
    """One simulated job: its world, the faults a seed may draw (at most ``faults`` of
    ``kinds``, every kind if empty), the timeouts, and the liveness bound."""

    world_size: int = 3
    steps: int = 6
    elastic: bool = False
    min_replicas: int | None = None
    per_node: int = 1
    faults: int = 2
    kinds: tuple[str, ...] = ()
    checkpoint_every: int = 0
    allow_fresh_start: bool = False
    rollback_timeout_s: float = 1.0
    regroup_timeout_s: float = REGROUP_TIMEOUT_S
    start_timeout_s: float = 30.0
    hang_timeout_s: float = 2.0
    restart_s: tuple[float, float] = (0.3, 1.5)
    lease_s: float = 0.3
    max_recoveries: int = 50
    max_restarts: int = 1000
    warm_spares: int = 0
    """``--warm-spares``: each node's ready spares (a restart takes one if there is one)."""
    spare_s: tuple[float, float] = (0.02, 0.08)
    """A spare's start as its worker (its imports done: the order, then the join)."""
    drain_grace_s: float = 5.0
    """``--drain-grace``: how long a draining node's agent waits before it stops them."""
    quarantine: str = "off"
    """``--quarantine`` (``N/S``, or ``off``: the simulated faults are drawn, not a slot's)."""
    liveness_s: float = 60.0
    """Longer than every timeout that ends a wait by design (the first start's 30 s)."""
    horizon_s: float = 900.0
    decide: str = "collective"
    """How a fault-free step is decided (``--decide``): ``collective`` or ``store``."""

    @property
    def min_members(self) -> int:
        if self.elastic:
            return self.min_replicas or self.world_size
        return self.world_size
