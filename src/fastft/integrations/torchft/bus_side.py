"""What the error bus tells a :class:`~fastft.integrations.torchft.ManagerFFT` replica:
a peer's death or report voids the step it is in (or, with quorum leases, the leased step
it breaks); a peer waiting in the lighthouse ends a lease; a joiner is admitted at the next
quorum. A mixin of ManagerFFT: the state it reads and writes is the manager's
(``lease``, ``_pending``, ``_reported``, ``_rolled_back``, ``_fft_lock``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastft.errors import FastFTError
from fastft.integrations.torchft.pg import BusProcessGroup
from fastft.integrations.torchft.quorum import parse_replica_id
from fastft.protocol.faults import fault_of
from fastft.protocol.messages import (
    DrainNotice,
    Fault,
    JoinRequest,
    Message,
    RollbackRequest,
    Severity,
)

__all__ = ["OnTheBus", "PeerFailed"]


class PeerFailed(FastFTError, RuntimeError):
    """A member of this step's quorum failed (told by the error bus): the step is void."""


class OnTheBus:
    """The bus side of ManagerFFT (see the module's docstring)."""

    # provided by ManagerFFT / torchft's Manager
    lease: Any
    _pending: Any
    _reported: list[Any]
    _rolled_back: tuple[int, int]
    _fft_lock: Any
    _pg: Any
    _quorum_id: int
    fft_rank: int
    fft_incarnation: int
    peer_faults: int
    interrupted: int
    _step: int

    if TYPE_CHECKING:  # (torchft's Manager and ManagerFFT define them: no stubs at run time)

        def current_step(self) -> int: ...

        def errored(self) -> Any: ...

        def _emit(self, event: str, **fields: Any) -> None: ...

    def _on_message(self, m: Message) -> None:
        me = (self.fft_rank, self.fft_incarnation)
        if isinstance(m, JoinRequest):
            # The next step asks; a step reused meanwhile completes (the joiner is in none
            # of its collectives). A peer that asked first is voided by _on_waiting.
            if (m.rank, m.incarnation) != me:
                self._break_lease((m.rank, m.incarnation), "joining", m, void_from=None)
            return
        if isinstance(m, RollbackRequest):
            if m.sender != me:
                self._on_waiting(m)
            return
        if isinstance(m, DrainNotice):
            if m.sender != me:
                with self._fft_lock:
                    self.lease.gone.add(m.sender)
                # It took part in every step before m.step: a leased step past that one
                # waits for it in vain; an earlier one completes as it is.
                self._break_lease(m.sender, "left", m, void_from=m.step)
            return
        r = fault_of(m)
        if r is None or r.who == me or r.rank < 0:
            return
        who = r.who
        # Here a Fault1 means the replica is gone (ManagerFFT reports its own Fault1 only
        # as its process ends: an uncaught exception); a Fault2 is a report of the step.
        report = m if isinstance(m, Fault) and r.severity is Severity.FAULT2 else None
        why = r.cause
        with self._fft_lock:
            t = self.lease
            news = report is not None or (who not in t.dead and who not in t.gone)
            if report is None:
                t.dead.add(who)
        # A replica that ended its loop cleanly had finished its collectives of the step
        # (it committed it), and one that announced leaving was handled then.
        if news and self._break_lease(who, why, m, void_from=None if r.clean_exit else 0):
            return
        if report is not None and not self._about_this_attempt(report):
            return
        with self._fft_lock:
            if r.clean_exit:
                # The lighthouse leaves it out of the next quorum, and the step in flight
                # here completes as it is.
                return
            members = self.lease.members
            if members is None and report is not None:
                self._reported.append((who, why, report))
        # While a quorum is being formed (members None) a death only goes in the dead set
        # (a report in the list above): _on_quorum fails the step if the new quorum still
        # holds that replica. Failing it now could void a step whose quorum already left
        # the dead replica out, and a replica that skips a step's collectives leaves its
        # peers waiting for Gloo's timeout.
        if members is None or who not in members:
            return
        self._fail_step(who, why, m)

    def _about_this_attempt(self, m: Fault) -> bool:
        """Whether a peer's Fault2 report is about the step this replica is attempting: the
        same step, and not an attempt this replica already rolled back (a late report
        from an earlier quorum while the step is retried in a new one). The sender's quorum
        id alone cannot tell: it may report before its own quorum of the step arrived."""
        step, quorum = self._rolled_back
        return m.step == self.current_step() and not (m.step == step and m.epoch <= quorum)

    def _break_lease(
        self, who: tuple[int, int], why: str, m: Message, void_from: int | None = 0
    ) -> bool:
        """See :meth:`LeaseTable.break_`; fails the leased step it voids (True then)."""
        with self._fft_lock:
            void = self.lease.break_(void_from)
        if void:
            self._fail_step(who, why, m)
        return void

    def _on_waiting(self, m: RollbackRequest) -> None:
        """A member of the last quorum waits in the lighthouse for step ``m.step`` (the
        lighthouse tells, once per quorum): see :meth:`LeaseTable.waiting`."""
        with self._fft_lock:
            void = self.lease.waiting(m.step)
        if void and self.errored() is None:  # (not yet voided by the fault that caused it)
            self._fail_step(m.sender, "waiting in the lighthouse", m)

    def _reuse_quorum(self) -> Any | None:
        """The quorum of this step if it may reuse the lease (torchft's quorum thread)."""
        with self._fft_lock:
            return self.lease.reuse(self._step)

    def _fail_step(self, who: tuple[int, int], why: str, m: Message | None) -> None:
        exc = PeerFailed(f"replica rank {who[0]} (incarnation {who[1]}): {why}")
        self.peer_faults += 1
        # The next quorum reconfigures the process group, abandoning collectives that may
        # be stuck on the peer (torchft's own works included, not only those we wait on):
        # the communicator they run on is kept forever (BusProcessGroup.reconfigure), or
        # its destructor at interpreter exit could abort the process after the job is done
        # (seen: SIGABRT, "terminate called without an active exception").
        self._pending.dirty = True
        self.lease.told = True
        super().report_error(exc)  # type: ignore[misc]  # torchft's (next in the MRO), not ours
        n = self._pending.fail_all(exc)
        if isinstance(self._pg, BusProcessGroup):
            self._pg.abort()  # NCCL only (see BusProcessGroup.abort)
        self.interrupted += n
        self._emit(
            "peer_fault",
            faulty_rank=who[0],
            cause=why,
            step=self.current_step(),
            interrupted=n,
            latency_ms=round((time.time() - m.wall_time) * 1000, 3) if m and m.wall_time else None,
        )

    def _on_quorum(self, q: Any) -> None:
        lives = {parse_replica_id(r) for r in getattr(q, "replica_ids", ())}
        with self._fft_lock:
            changed = q.quorum_id != self._quorum_id
            members = {x for x in lives if x is not None}
            dead = self.lease.quorum(q, members)
            reported, self._reported = self._reported, []
        if changed:
            self._emit(
                "quorum",
                quorum=q.quorum_id,
                members=sorted(r for r, _ in members),
                heal=bool(q.heal),
                max_step=q.max_step,
            )
        for who in dead:  # it died after the lighthouse formed this quorum
            self._fail_step(who, "dead member in the new quorum", None)
        if dead:
            return
        for who, why, m in reported:  # a member reported an error while this quorum formed
            if who in members and self._about_this_attempt(m):
                self._fail_step(who, why, m)
                return
