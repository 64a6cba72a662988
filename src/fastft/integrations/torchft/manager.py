"""``ManagerFFT``: torchft's ``Manager`` on fastft's error bus.

A torchft survivor learns of a dead or hung peer only when a collective times out or the
lighthouse stops seeing the peer's heartbeats (seconds to a minute). ``ManagerFFT`` is a
drop-in subclass that joins the job's error bus (``fastft run --torchft`` provides it):

* ``report_error(e)`` does what torchft does and also broadcasts a :class:`Fault` (cause,
  rank, incarnation, step), and an uncaught exception is broadcast before the process dies;
* a peer's fault, a death or stop seen by a node agent, or a hang an agent reports, for a
  member of the current quorum, marks the step errored *now* and fails the in-flight
  collectives, so the DDP hook returns, ``should_commit()`` says no at once, and the next
  quorum (from :class:`~fastft.integrations.torchft.lighthouse.BusLighthouse`, which hears
  the same deaths) leaves the dead replica out without waiting for its heartbeat to expire;
* bus messages that are not in the protocol are logged and counted, never fatal (the bus
  endpoint does it).

Failing a blocked collective: :mod:`fastft.integrations.torchft.pg`; quorum leases:
:mod:`fastft.integrations.torchft.lease`.

Everything the launcher does not provide falls back to torchft's behaviour: outside
``fastft run`` there is no bus and ``ManagerFFT`` is a plain ``Manager`` with a warning.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torchft.manager import Manager
from torchft.process_group import ProcessGroup

from fastft.bus import BusEndpoint, connect_store
from fastft.inject import FaultSpec, execute
from fastft.integrations.torchft.bus_side import OnTheBus, PeerFailed
from fastft.integrations.torchft.lease import LeaseTable
from fastft.integrations.torchft.pg import Pending, wrap
from fastft.integrations.torchft.replica import QuorumTap, under_fastft_kwargs
from fastft.process.env import SPARE_RUN_AHEAD, WorkerEnv
from fastft.process.events import EventLog
from fastft.process.heartbeat import HeartbeatWriter
from fastft.process.services import Services
from fastft.protocol.messages import (
    DrainNotice,
    Fault,
    Message,
    Severity,
)

__all__ = ["ManagerFFT", "PeerFailed"]

log = logging.getLogger(__name__)


QUORUM_EVERY = 64
"""ManagerFFT's default ``quorum_every``: a replica that joins without a lighthouse that
announces it (torchft's own) waits at most this many steps."""


class ManagerFFT(OnTheBus, Manager):
    """``torchft.Manager`` that joins fastft's error bus. Same arguments as ``Manager``.

    Under ``fastft run --torchft`` every worker is one replica group of one process; its
    replica id becomes ``fastft-<rank>-<incarnation>/<replica_id>``, when no store is
    given (``store_addr``/``MASTER_ADDR``) the manager hosts its group's store itself, and
    ``heartbeat_interval`` defaults to 1 s instead of 100 ms (the bus, not the lighthouse's
    heartbeat timeout, reports a dead replica).

    ``quorum_every`` (fastft's): while the bus reports nothing about the quorum's members
    and nobody joins, a step reuses the previous step's quorum instead of asking the
    lighthouse, and every ``quorum_every``-th step asks anyway (1: every step, as torchft).
    Only under ``fastft run`` and with replica groups of one process. Why it is safe, and
    what it costs a joiner: ``docs/measurements.md``, "Quorum leases".
    """

    def __init__(
        self,
        pg: ProcessGroup,
        *args: Any,
        quorum_every: int | None = None,
        bus: WorkerEnv | None = None,
        **kwargs: Any,
    ) -> None:
        if quorum_every is not None and (
            isinstance(quorum_every, bool) or not isinstance(quorum_every, int) or quorum_every < 1
        ):
            raise ValueError(f"quorum_every={quorum_every!r}: must be an integer >= 1")
        if os.environ.get(SPARE_RUN_AHEAD):  # a warm spare that ran the script ahead:
            from fastft.process.order import await_order

            await_order()  # it becomes its replica here
        env = os.environ
        if bus is None and WorkerEnv.present(env):
            bus = WorkerEnv.from_env(env)  # under `fastft run`
        self._fft_store_server: Any = None
        self.bus: BusEndpoint | None = None
        self.events: EventLog | None = None
        self._hb = HeartbeatWriter(None)
        self._clean = True  # (no rollback since the last commit: the heartbeat's pace)
        self._reported: list[tuple[tuple[int, int], str, Fault]] = []
        """Fault2 reports that arrived while a quorum was being formed: _on_quorum decides."""
        self._rolled_back: tuple[int, int] = (-1, -1)
        """(step, quorum id) of this replica's last rolled-back attempt."""
        self.lease = LeaseTable()
        """Quorum leases (they need the bus); off unless turned on below."""
        self._fft_lock = threading.Lock()
        self._pending = Pending()
        self.peer_faults = 0
        self.interrupted = 0
        if bus is not None:
            self.fft_rank = bus.rank
            self.fft_incarnation = bus.incarnation or (secrets.randbits(62) | 1)
            self._fft_store_server = under_fastft_kwargs(
                kwargs, env, self.fft_rank, self.fft_incarnation, store=bus.store
            )
        else:
            self.fft_rank, self.fft_incarnation = -1, 0
            log.warning(
                "ManagerFFT without an error bus (not under `fastft run`, and no bus= "
                "argument: see fastft.integrations.torchft.connect): a plain torchft Manager"
            )
        if bus is None:  # nothing to relay: torchft's Manager, its group and client as is
            super().__init__(pg, *args, **kwargs)
            return
        super().__init__(wrap(pg, self._pending), *args, **kwargs)
        client = self._client  # type: ignore[has-type]
        self._client = QuorumTap(client, self._reuse_quorum, self._on_quorum)
        if quorum_every is None:
            # Leases hold back a replica that joins late unless its join is announced on
            # the bus (BusLighthouse does): elsewhere, torchft's every-step quorum.
            quorum_every = QUORUM_EVERY if bus.lighthouse == "bus" else 1
        if int(kwargs.get("world_size") or env.get("WORLD_SIZE", "1")) == 1:
            # A group of several processes would need its ranks to agree on every reuse.
            self.lease.quorum_every = quorum_every
        self._fft_store = connect_store(bus.store)
        label = f"replica {self.fft_rank}"
        sv = Services.start(
            self._fft_store,
            bus,
            rank=self.fft_rank,
            incarnation=self.fft_incarnation,
            label=label,
            on_message=self._on_message,
            fire=self._inject,
            events=EventLog(bus.run_dir, label) if bus.run_dir else None,
        )
        self.events = sv.events if bus.run_dir else None
        self._hb, self.bus, self.injector = sv.heartbeat, sv.bus, sv.injector
        self._pending.on_block = self._hb.waiting
        self._prev_hook = sys.excepthook
        sys.excepthook = self._excepthook
        self._emit("replica_start", replica_id=self._replica_id)

    # --- torchft's API, extended -----------------------------------------------------------
    def report_error(self, e: Exception) -> None:
        """torchft's ``report_error``; also tells every peer, unless ``e`` is a consequence
        of a peer's fault that the bus already told."""
        super().report_error(e)
        if isinstance(e, PeerFailed) or self._pending.poisoned is not None:
            return
        self.lease.told = True
        self._broadcast_fault("reported_error", e)

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        self._hb.beat()
        if self.bus is not None:
            self.injector.fire_due(self.current_step())
        with self._hb.blocked:
            prev = self._quorum_future
            if prev is not None:
                # torchft waits for the previous quorum here too; waiting first keeps that
                # quorum's bookkeeping (its tap) before this attempt's (a step without
                # collectives can reach should_commit before its quorum thread ran)
                prev.result()
            self._begin_attempt()
            super().start_quorum(*args, **kwargs)

    def allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.bus is not None and self.injector.pending:
            # After the quorum (torchft waits for it here anyway): a fault at point
            # "collective" then hits a step whose peers are in, or entering, the allreduce.
            self.wait_quorum()
            self.injector.fire_due(self.current_step(), point="collective")
        return super().allreduce(tensor, *args, **kwargs)

    def wait_quorum(self) -> None:
        fut = self._quorum_future
        if fut is not None and fut.done():  # torchft asks several times per step
            return super().wait_quorum()
        with self._hb.blocked:
            super().wait_quorum()

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        with self._hb.blocked:
            ok = super().should_commit(timeout)
        if ok:
            self._hb.committed(clean=self._clean)
        else:
            self._hb.unsettle()  # (the next quorum may re-form: not the pace's step)
        self._clean = ok
        self._hb.beat()
        self._end_attempt(ok)
        self._emit(
            "commit" if ok else "rollback",
            step=self.current_step() - (1 if ok else 0),
            epoch=self._quorum_id,  # a quorum is what an epoch is to the native runtime
            quorum=self._quorum_id,
            reason="" if ok else repr(self.errored())[:300],
        )
        return ok

    # --- quorum leases (docs/measurements.md, "Quorum leases") -------------------------------
    @property
    def quorum_every(self) -> int:
        return self.lease.quorum_every

    @property
    def quorums_reused(self) -> int:
        return self.lease.reused

    def _begin_attempt(self) -> None:
        with self._fft_lock:
            self.lease.begin_attempt()

    def _end_attempt(self, ok: bool) -> None:
        """The attempt committed (torchft's step already counts it) or rolled back."""
        with self._fft_lock:
            told = self.lease.end_attempt(ok)
        if ok:
            return
        self._rolled_back = (self.current_step(), self._quorum_id)
        if not told and self.quorum_every > 1:
            # Peers that committed this step would run the next on the lease while this
            # replica asks the lighthouse: tell them, so that they void theirs.
            self._broadcast_fault("rolled_back", RuntimeError(repr(self.errored())[:300]))

    def shutdown(self, wait: bool = True) -> None:
        if self.bus is not None:
            # Peers that reuse their quorum would otherwise wait for this replica in their
            # next step's collectives (see _on_message).
            self._tell(DrainNotice, reason="shutdown")
            self.bus.close()
        self._hb.close()
        self._emit(
            "replica_end",
            step=self.current_step(),
            quorums_reused=self.quorums_reused,
            peer_faults=self.peer_faults,
        )
        super().shutdown(wait=wait)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_hook  # the process goes on without the bus
        if self.events is not None:
            self.events.close()

    def _broadcast_fault(
        self, cause: str, e: BaseException, severity: Severity = Severity.FAULT2
    ) -> None:
        self._tell(
            Fault,
            severity=severity,
            cause=cause,
            faulty_rank=self.fft_rank,
            faulty_incarnation=self.fft_incarnation,
            detail=f"{type(e).__name__}: {e}"[:2000],
        )

    def _tell(self, kind: Callable[..., Message], **fields: Any) -> None:
        """Broadcast a ``kind`` message from this replica at its step, if the bus is up;
        telling peers must never add a failure (a bus error is logged)."""
        if self.bus is None or self.bus.closed:
            return
        try:
            self.bus.broadcast(
                kind(
                    job=self.bus.config.job,
                    epoch=max(self._quorum_id, 0),
                    rank=self.fft_rank,
                    incarnation=self.fft_incarnation,
                    step=self.current_step(),
                    **fields,
                )
            )
        except Exception:
            log.exception("could not broadcast %s", getattr(kind, "__name__", kind))

    def _excepthook(self, *args: Any) -> None:
        if len(args) == 3 and isinstance(args[1], Exception):
            # This process is going away (its state with it): Fault1, so the lighthouse and
            # the peers drop it now rather than when the interpreter has finished exiting.
            self._broadcast_fault("uncaught_exception", args[1], Severity.FAULT1)
        self._prev_hook(*args)
        if self.bus is not None and not self.bus.closed:
            # End now, with status 1: interpreter teardown would run torch's C++
            # destructors, which abort ("terminate called without an active exception")
            # or wait on a peer, so the replica would be restarted late or counted as a
            # crash after the job ended.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _inject(self, spec: FaultSpec) -> None:
        """Fire a planned fault, logged first (``fastft report`` times it from here)."""
        self._emit(
            "injected",
            kind=spec.kind.value,
            point=spec.point,
            step=self.current_step(),
            epoch=self._quorum_id,
            incarnation=self.fft_incarnation,
        )
        execute(spec)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, **fields)
