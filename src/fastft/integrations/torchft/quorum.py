"""torchft's quorum rule, with fastft's additions: a replica the error bus reported dead
is unhealthy at once, a quorum in which a member failed its last commit gets a new id, and
(under ``fastft run``) the job's first quorum waits for every replica the launcher started.

This is the pure core of :class:`~fastft.integrations.torchft.lighthouse.BusLighthouse`: no
clock, no I/O. The rule is torchft's lighthouse rule (``quorum_compute`` in its
``lighthouse.rs``), unchanged, so a job behaves as under torchft's own lighthouse with the
same settings -- except that a replica whose process the node agent saw die (or stop, or
hang) drops out of the healthy set now instead of ``heartbeat_timeout`` after its last
heartbeat. That wait is what costs a torchft job ~5 s per lost replica with default
settings: until the dead replica's heartbeat expires, the survivors' next quorum waits for
it as a straggler.

The new id after a failed commit: a step that failed on a peer's fault leaves collectives
abandoned on the members' communicators (ManagerFFT fails them without waiting, and a
member that failed before its allreduce never issued its own). torchft rebuilds the process
group only when the quorum id changes, and under torchft's rule the id changes only with
the membership. A failed commit in an unchanged membership would otherwise keep the old
communicator, whose next collective then meets the abandoned one. Every member of such a
quorum rebuilds its process group, which costs a few milliseconds, only after a failed step.

Replica ids tie a torchft replica to a fastft worker: :class:`ManagerFFT` names its replica
``fastft-<rank>-<incarnation>/<user id>`` (torchft appends ``:<uuid>``), so a bus report
about (rank, incarnation) names exactly one life of one replica.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "LighthouseOptions",
    "QuorumMember",
    "QuorumState",
    "compute_quorum",
    "fastft_replica_id",
    "parse_replica_id",
]

_ID = re.compile(r"^fastft-(\d+)-(\d+)/")


def fastft_replica_id(rank: int, incarnation: int, user_id: str) -> str:
    """The replica id :class:`ManagerFFT` gives torchft for worker ``rank`` in one life."""
    return f"fastft-{rank}-{incarnation}/{user_id}"


def parse_replica_id(replica_id: str) -> tuple[int, int] | None:
    """(rank, incarnation) of a replica id made by :func:`fastft_replica_id`, else None."""
    m = _ID.match(replica_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class LighthouseOptions:
    """torchft's lighthouse flags, with torchft's defaults."""

    min_replicas: int = 1
    join_timeout_ms: int = 60_000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5_000
    first_quorum: int = 0
    """fastft's: the job's first quorum waits until this many replicas joined (the
    replicas the launcher started), at most ``join_timeout_ms``; 0: torchft's rule, under
    which the first replicas that are up start training without a slower-starting one
    (``min_replica_size=1`` in torchft's example), which then heals from them."""

    def __post_init__(self) -> None:
        for name in ("min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"lighthouse {name}={getattr(self, name)}: must be >= 1")
        if self.first_quorum < 0:
            raise ValueError(f"lighthouse first_quorum={self.first_quorum}: must be >= 0")


@dataclass(frozen=True)
class QuorumMember:
    """One quorum request: the replica id, its step and whether it asked to shrink only.
    ``raw`` is the request's member record as received; it is sent back unchanged."""

    replica_id: str
    step: int = 0
    shrink_only: bool = False
    raw: bytes = b""
    commit_failures: int = 0
    """Failed commits since the member's last successful one (torchft sends it)."""


@dataclass
class QuorumState:
    """What the lighthouse knows. Times are seconds on one monotonic clock."""

    participants: dict[str, tuple[float, QuorumMember]] = field(default_factory=dict)
    heartbeats: dict[str, float] = field(default_factory=dict)
    prev: tuple[QuorumMember, ...] | None = None
    quorum_id: int = 0
    dead: set[str] = field(default_factory=set)
    """Replicas the bus reported dead: never healthy again (a new life has a new id)."""

    def healthy(self, now: float, opt: LighthouseOptions) -> set[str]:
        limit = opt.heartbeat_timeout_ms / 1000
        return {r for r, t in self.heartbeats.items() if now - t < limit and r not in self.dead}


def compute_quorum(
    now: float, state: QuorumState, opt: LighthouseOptions
) -> tuple[tuple[QuorumMember, ...] | None, str]:
    """The next quorum (participants sorted by replica id) or None, and why."""
    healthy = state.healthy(now, opt)
    joined = {r: v for r, v in state.participants.items() if r in healthy}
    candidates = sorted((m for _, m in joined.values()), key=lambda m: m.replica_id)
    shrink_only = any(m.shrink_only for _, m in joined.values())
    meta = (
        f"[{len(joined)}/{len(state.participants)} participants healthy]"
        f"[{len(healthy)} heartbeating][shrink_only={shrink_only}]"
    )
    if state.prev is not None:
        prev_ids = {m.replica_id for m in state.prev}
        if shrink_only:
            candidates = [m for m in candidates if m.replica_id in prev_ids]
        # Fast quorum: every member of the previous quorum asked again.
        if all(r in joined for r in prev_ids):
            return tuple(candidates), f"fast quorum {meta}"
    if len(joined) < opt.min_replicas:
        return None, f"only {len(joined)} participants, need {opt.min_replicas} {meta}"
    first = min((t for t, _ in joined.values()), default=now)
    if (
        state.prev is None
        and len(joined) < opt.first_quorum
        and now - first < opt.join_timeout_ms / 1000
    ):
        return None, f"first quorum: {len(joined)} of {opt.first_quorum} replicas {meta}"
    if len(joined) <= len(healthy) // 2:  # split brain: at least half the live replicas
        return None, f"only {len(joined)} of {len(healthy)} healthy replicas joined {meta}"
    all_joined = len(joined) == len(healthy)
    if not all_joined and now - first < opt.join_timeout_ms / 1000:
        return None, f"waiting {len(healthy) - len(joined)} stragglers {meta}"
    return tuple(candidates), f"quorum {meta}"


def quorum_changed(a: tuple[QuorumMember, ...], b: tuple[QuorumMember, ...] | None) -> bool:
    """Whether quorum ``a`` after ``b`` needs a new id: other members (torchft's rule), or a
    member whose last commit failed (see the module docstring)."""
    return (
        b is None
        or [m.replica_id for m in a] != [m.replica_id for m in b]
        or any(m.commit_failures > 0 for m in a)
    )
