"""Quorum leases for ``ManagerFFT``, as a table of state with no I/O, no locks and no clock
(the manager holds its lock around every call and performs what the calls return).

A committed quorum in which every member was at its max step is reused by the following
steps instead of asking the lighthouse, while the bus reports nothing that breaks it; every
``quorum_every``-th step asks anyway. Why it is safe: ``docs/measurements.md``, "Quorum
leases".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LeaseTable", "Reused", "lease_eligible"]

Life = tuple[int, int]
"""(rank, incarnation) of a replica's life."""


def lease_eligible(q: Any) -> bool:
    """Whether later steps may reuse quorum ``q``: nobody heals or sends state in it, so
    every member was at its max step. All members see the same answer (the fields are the
    quorum's, not the member's)."""
    return int(q.max_world_size) == int(q.replica_world_size)


class Reused:
    """The lease's quorum answered for ``step``: torchft's QuorumResult, step moved on."""

    def __init__(self, quorum: Any, step: int) -> None:
        self._quorum = quorum
        self.max_step = step
        self.heal = False
        self.recover_dst_replica_ranks: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


@dataclass
class LeaseTable:
    quorum_every: int = 1
    lease: tuple[Any, frozenset[Life]] | None = None
    """A committed quorum that the following steps reuse, with its members."""
    candidate: tuple[Any, frozenset[Life], int] | None = None
    """This step's real quorum when eligible: a lease once the step commits."""
    breaks: int = 0
    """Lease-breaking messages heard so far (see :meth:`break_`)."""
    asked_at: int = 0
    """``breaks`` when this step asked the lighthouse: a quorum is leased only if nothing
    broke since (the quorum may predate what was told)."""
    leased_step: int | None = None
    """The step the attempt in flight runs on the lease (None: it asked the lighthouse).
    Not torchft's ``_step``, which counts the commit before the attempt's bookkeeping ends:
    a message between the two would void a step that completed."""
    asked_step: int | None = None
    """The step the attempt in flight asked the lighthouse for (None: no attempt in flight,
    not asked yet, or leased)."""
    told: bool = False
    """This attempt's failure is known to the peers (the bus told it, or we did)."""
    members: set[Life] | None = None
    """The current quorum's lives; None while a quorum is formed."""
    dead: set[Life] = field(default_factory=set)
    gone: set[Life] = field(default_factory=set)
    """Lives that announced leaving (``DrainNotice``)."""
    reused: int = 0

    def begin_attempt(self) -> None:
        """A step's attempt starts: its quorum is not known yet."""
        self.members = None
        self.leased_step = None
        self.told = False
        self.asked_step = None

    def end_attempt(self, ok: bool) -> bool:
        """The attempt committed or rolled back; returns whether its failure was told (a
        rollback nobody told must be: peers would run the next step on the lease)."""
        if not ok:
            self.lease = None
        elif self.leased_step is None:  # asked the lighthouse: its quorum, if eligible
            self.lease = None
            if self.candidate is not None:
                quorum, members, asked_at = self.candidate
                if asked_at == self.breaks:
                    self.lease = (quorum, members)
        self.candidate = None
        self.leased_step = None
        self.asked_step = None
        told, self.told = self.told, True
        return told

    def break_(self, void_from: int | None = 0) -> bool:
        """Something the lease did not foresee was told (a fault, a death, a join, a member
        leaving): no step reuses a quorum from before it. Returns whether the leased step
        in flight must be voided: one at or past ``void_from`` (None: none is; a join, or a
        member that took part in all of it). Every replica hears the same message, so every
        one that might reuse the lease either did not yet (it asks the lighthouse) or is
        inside a leased step (voided): none waits in a collective for a peer that went to
        the lighthouse. Whether the message concerns this replica's quorum is
        deliberately not asked: replicas can differ in what they know of the quorum."""
        self.breaks += 1
        self.lease = None
        leased = self.leased_step
        return void_from is not None and leased is not None and leased >= void_from

    def waiting(self, step: int) -> bool:
        """A member of the last quorum waits in the lighthouse for ``step``. A leased step
        at or past it cannot complete and must be voided (returns True); an earlier one
        completes and the next step asks. An attempt that asked already is unchanged."""
        if self.asked_step is not None:
            return False
        self.lease = None
        return self.leased_step is not None and self.leased_step >= step

    def reuse(self, step: int) -> Reused | None:
        """The quorum of ``step`` if it may reuse the lease, else None (it asks)."""
        lease = self.lease
        if lease is None or step % self.quorum_every == 0 or lease[1] & self.dead:
            self.asked_at = self.breaks
            self.asked_step = step
            return None
        self.members = set(lease[1])
        self.leased_step = step
        self.reused += 1
        return Reused(lease[0], step)

    def quorum(self, q: Any, members: set[Life]) -> set[Life]:
        """A real quorum arrived with these lives; returns the dead among them (the step
        must fail)."""
        self.members = members
        dead = members & self.dead
        eligible = self.quorum_every > 1 and not dead and lease_eligible(q)
        self.candidate = (q, frozenset(members), self.asked_at) if eligible else None
        return dead
