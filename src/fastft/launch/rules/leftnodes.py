"""Nodes that left the job before it finished (their agent drained: a preemption) as the
other agents see them, and how long a world that cannot go on without their workers waits
for them (pure: time comes in as arguments). Without this, a fixed world's survivors
waited for the drained node's ranks for ever, and said nothing (issue 63's simulator)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LeftNodes", "needs_node"]


def needs_node(world_size: int, node_workers: int, min_replicas: int | None) -> bool:
    """Whether the job cannot go on without one node's ``node_workers`` workers: a fixed
    world, or an elastic one whose floor (``--min-replicas``) the rest does not reach."""
    return world_size - node_workers < (min_replicas or world_size)


@dataclass
class LeftNodes:
    """The nodes this agent saw leave, each with the time the job fails unless it returns."""

    until: dict[int, float] = field(default_factory=dict)

    def left(self, node: int, until: float) -> bool:
        """``node`` left, waited for until ``until``: True if this is news."""
        if node in self.until:
            return False
        self.until[node] = until
        return True

    def back(self, node: int) -> bool:
        """``node``'s agent started again: True if it was waited for."""
        return self.until.pop(node, None) is not None

    def overdue(self, now: float) -> list[int]:
        """The nodes whose wait ran out."""
        # (a copy first: the lease's thread adds nodes while the agent's loop asks)
        return sorted(n for n, t in list(self.until.items()) if now > t)
