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

Failing a blocked collective: the process group is wrapped so that every collective's
``wait()`` waits on a future of ours, which the collective's completion resolves *or* a bus
fault fails (a Gloo ``abort()`` does not release an allreduce whose peer is stopped). The
abandoned operation keeps running on the old communicator, which torchft replaces at the
next quorum; it is kept alive (its destructor would block on the dead peer) and the process
ends without running destructors. On NCCL (or XCCL) the works are not wrapped: the
communicator is aborted instead, which NCCL supports. Chosen by the process group's
backend, not by whether CUDA is present (Gloo on a GPU machine is wrapped). Not checked on
a GPU: the one lent to this work cannot hold two NCCL ranks.

Everything the launcher does not provide falls back to torchft's behaviour: outside
``fastft run`` there is no bus and ``ManagerFFT`` is a plain ``Manager`` with a warning.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.manager import Manager
from torchft.process_group import ProcessGroup, ProcessGroupWrapper

from fastft.bus import BusConfig, BusEndpoint, connect_store, tcpstore_bus
from fastft.errors import FastFTError
from fastft.inject import FaultPlan, FaultSpec, Injector, execute
from fastft.integrations.torchft.quorum import fastft_replica_id, parse_replica_id
from fastft.protocol.messages import (
    DrainNotice,
    Fault,
    HangSuspected,
    JoinRequest,
    Message,
    ProcessExited,
    RollbackRequest,
    Severity,
)
from fastft.runtime.contract import ENV, SPARE_RUN_AHEAD, STACKS_SIGNAL
from fastft.runtime.events import EventLog
from fastft.runtime.sentinel import start_exit_sentinel
from fastft.runtime.worker import Heartbeat, exit_without_destructors_later

__all__ = ["ManagerFFT", "PeerFailed"]

log = logging.getLogger(__name__)


class PeerFailed(FastFTError, RuntimeError):
    """A member of this step's quorum failed (told by the error bus): the step is void."""


class _Pending:
    """The in-flight collectives of the current communicator, and whether it is poisoned
    (a member is known dead: new collectives fail at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.futures: set[torch.futures.Future[Any]] = set()
        self.poisoned: Exception | None = None
        self.abandoned: list[Any] = []
        """Works abandoned in flight and the communicators they run on: never destroyed."""
        self.dirty = False
        """An operation was abandoned on the current communicator."""
        self.on_block: Callable[[bool], None] = lambda on: None

    def fail_all(self, exc: Exception) -> int:
        with self.lock:
            self.poisoned = exc
            futs, self.futures = self.futures, set()
        n = 0
        for f in futs:
            try:
                f.set_exception(exc)
                n += 1
            except RuntimeError:  # completed meanwhile
                pass
        return n


class _BusWork(dist._Work):
    """A collective whose ``wait()`` a bus fault can end."""

    def __init__(self, work: dist._Work, pending: _Pending) -> None:
        super().__init__()
        self._work = work
        self._pending = pending
        self._fut: torch.futures.Future[Any] = torch.futures.Future()
        with pending.lock:
            poisoned = pending.poisoned
            if poisoned is None:
                pending.futures.add(self._fut)
        if poisoned is not None:
            self._fut.set_exception(poisoned)
            pending.abandoned.append(work)
            pending.dirty = True
            return
        fut = self._fut

        def relay(src: torch.futures.Future[Any]) -> None:
            with pending.lock:
                pending.futures.discard(fut)
            try:
                value = src.value()
            except Exception as e:  # the collective failed by itself
                try:
                    fut.set_exception(e)
                except RuntimeError:
                    pass
                return
            try:
                fut.set_result(value)
            except RuntimeError:  # already failed by a bus fault
                pass

        work.get_future().then(relay)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._pending.on_block(True)
        try:
            self._fut.wait()
        except Exception:
            self._pending.abandoned.append(self._work)  # still running: keep it alive
            self._pending.dirty = True
            exit_without_destructors_later()
            raise
        finally:
            self._pending.on_block(False)
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def synchronize(self) -> None:
        pass

    def block_current_stream(self) -> None:
        pass


def _aborts_release_waiters(pg: ProcessGroup) -> bool:
    """Whether aborting ``pg`` releases a collective stuck on a dead peer: NCCL's (and
    XCCL's) communicator abort does; Gloo's does not, so its works are wrapped instead.
    Decided by the backend, not by whether CUDA is present: Gloo runs on GPU machines too."""
    try:
        name = pg.getBackendName()
    except NotImplementedError:
        return False
    return "nccl" in name or "xccl" in name


class _BusProcessGroup(ProcessGroupWrapper):
    """Wraps the user's torchft process group; collectives return :class:`_BusWork`."""

    def __init__(self, pg: ProcessGroup, pending: _Pending) -> None:
        super().__init__(pg=pg)
        self._inner = pg
        self._pending = pending
        self._wrap = not _aborts_release_waiters(pg)

    def _wrap_work(self, work: dist._Work, opts: object) -> dist._Work:
        return _BusWork(work, self._pending) if self._wrap else work

    def reconfigure(self, opts: Any) -> Any:
        with self._pending.lock:
            self._pending.poisoned = None
        if self._pending.dirty:
            # The old communicator still runs an abandoned operation: keep it referenced
            # (torchft drops it now; its destructor would wait for the dead peer).
            self._pending.abandoned.append(self._inner.parent)
            self._pending.dirty = False
        return super().reconfigure(opts)

    def abort(self, errored: bool = True) -> None:
        if not self._wrap:  # NCCL: aborting the communicator releases its waiters
            self._inner.abort(errored)

    def errored(self) -> Exception | None:
        return self._inner.errored()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    def shutdown(self) -> None:
        self._inner.shutdown()


class _QuorumTap:
    """Forwards to torchft's ManagerClient and reports each quorum's members; answers from
    ``reuse`` (a leased quorum) instead when it has one."""

    def __init__(
        self, client: Any, reuse: Callable[[], Any], on_quorum: Callable[[Any], None]
    ) -> None:
        self._client = client
        self._reuse = reuse
        self._on_quorum = on_quorum

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        q = self._reuse()
        if q is not None:
            return q
        q = self._client._quorum(*args, **kwargs)
        self._on_quorum(q)
        return q

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


QUORUM_EVERY = 64
"""ManagerFFT's default ``quorum_every``: a replica that joins without a lighthouse that
announces it (torchft's own) waits at most this many steps."""


def _lease_eligible(q: Any) -> bool:
    """Whether later steps may reuse quorum ``q``: nobody heals or sends state in it, so
    every member was at its max step. All members see the same answer (the fields are the
    quorum's, not the member's)."""
    return int(q.max_world_size) == int(q.replica_world_size)


class _Lease:
    """A committed quorum that the following steps reuse without asking the lighthouse."""

    def __init__(self, quorum: Any, members: frozenset[tuple[int, int]]) -> None:
        self.quorum = quorum
        self.members = members


class _Reused:
    """The lease's quorum answered for ``step``: torchft's QuorumResult, step moved on."""

    def __init__(self, quorum: Any, step: int) -> None:
        self._quorum = quorum
        self.max_step = step
        self.heal = False
        self.recover_dst_replica_ranks: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


def _advertised_host() -> str:
    store = os.environ.get(ENV["store"], "")
    return "127.0.0.1" if store.startswith("127.0.0.1:") else socket.gethostname()


class ManagerFFT(Manager):
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
    what it costs a joiner: ``docs/architecture.md``, "Quorum leases".
    """

    def __init__(
        self, pg: ProcessGroup, *args: Any, quorum_every: int = QUORUM_EVERY, **kwargs: Any
    ) -> None:
        if isinstance(quorum_every, bool) or not isinstance(quorum_every, int) or quorum_every < 1:
            raise ValueError(f"quorum_every={quorum_every!r}: must be an integer >= 1")
        if os.environ.get(SPARE_RUN_AHEAD):  # a warm spare that ran the script ahead:
            from fastft.launch.spare import await_order

            await_order()  # it becomes its replica here
        env = os.environ
        self._fft_store_server: Any = None
        self.bus: BusEndpoint | None = None
        self.events: EventLog | None = None
        self._hb = Heartbeat(None)
        self._members: set[tuple[int, int]] | None = None
        """(rank, incarnation) of the current quorum; None while a quorum is formed."""
        self._dead: set[tuple[int, int]] = set()
        self._reported: list[tuple[tuple[int, int], str, Fault]] = []
        """Fault2 reports that arrived while a quorum was being formed: _on_quorum decides."""
        self._rolled_back: tuple[int, int] = (-1, -1)
        """(step, quorum id) of this replica's last rolled-back attempt."""
        self.quorum_every = 1
        """Set to the argument under ``fastft run`` (leases need the bus)."""
        self._lease: _Lease | None = None
        self._candidate: tuple[Any, frozenset[tuple[int, int]], int] | None = None
        """This step's real quorum when eligible: a lease once the step commits."""
        self._breaks = 0
        """Lease-breaking messages heard so far (see _break_lease)."""
        self._asked_at = 0
        """``_breaks`` when this step asked the lighthouse: a quorum is leased only if
        nothing broke since (the quorum may predate what was told)."""
        self._gone: set[tuple[int, int]] = set()
        """Lives that announced leaving (``DrainNotice``)."""
        self._leased_step: int | None = None
        """The step the attempt in flight runs on the lease (None: it asked the lighthouse).
        Not torchft's ``_step``, which counts the commit before the attempt's bookkeeping
        ends: a message between the two would void a step that completed."""
        self._told = False
        """This attempt's failure is known to the peers (the bus told it, or we did)."""
        self._asked_step: int | None = None
        """The step the attempt in flight asked the lighthouse for (None: no attempt in
        flight, not asked yet, or leased)."""
        self.quorums_reused = 0
        self._fft_lock = threading.Lock()
        self._pending = _Pending()
        self.peer_faults = 0
        self.interrupted = 0
        under_fastft = bool(env.get(ENV["store"]))
        if under_fastft:
            self.fft_rank = int(env[ENV["rank"]])
            self.fft_incarnation = int(env[ENV["incarnation"]])
            kwargs["replica_id"] = fastft_replica_id(
                self.fft_rank,
                self.fft_incarnation,
                str(kwargs.get("replica_id") or env.get("REPLICA_GROUP_ID", self.fft_rank)),
            )
            kwargs.setdefault("hostname", _advertised_host())
            # The bus reports a replica's death; the lighthouse's heartbeat (5 s timeout)
            # is only the backstop for a node lost with its agent. torchft beats every
            # 100 ms, and each beat costs the Python BusLighthouse ~0.7 ms of CPU
            # (bench/lighthouse_rpc.py).
            kwargs.setdefault("heartbeat_interval", timedelta(seconds=1))
            if (
                kwargs.get("store_addr") is None
                and "MASTER_ADDR" not in env
                and int(kwargs.get("world_size") or env.get("WORLD_SIZE", "1")) == 1
            ):
                self._fft_store_server = dist.TCPStore(
                    "127.0.0.1", 0, is_master=True, wait_for_workers=False
                )
                kwargs["store_addr"] = "127.0.0.1"
                kwargs["store_port"] = self._fft_store_server.port
                kwargs.setdefault("rank", 0)
                kwargs.setdefault("world_size", 1)
        else:
            self.fft_rank, self.fft_incarnation = -1, 0
            log.warning("ManagerFFT outside `fastft run`: no error bus, plain torchft Manager")
        super().__init__(_BusProcessGroup(pg, self._pending), *args, **kwargs)
        client = self._client  # type: ignore[has-type]
        self._client = _QuorumTap(client, self._reuse_quorum, self._on_quorum)
        if not under_fastft:
            return
        if int(kwargs.get("world_size") or env.get("WORLD_SIZE", "1")) == 1:
            # A group of several processes would need its ranks to agree on every reuse.
            self.quorum_every = quorum_every
        run_dir = env.get(ENV["run_dir"])
        if run_dir:
            self.events = EventLog(run_dir, f"replica {self.fft_rank}")
        self._hb = Heartbeat(env.get(ENV["heartbeat"]))
        start_exit_sentinel(env.get(ENV["exit_trace"]))
        self._pending.on_block = self._hb.waiting
        if threading.current_thread() is threading.main_thread():
            # The agent sends it before it kills a replica it found hung: stacks first.
            faulthandler.register(STACKS_SIGNAL, all_threads=True)
        self._store = connect_store(env[ENV["store"]])
        self.bus = tcpstore_bus(
            self._store,
            BusConfig(job=env[ENV["job"]], rank=self.fft_rank, incarnation=self.fft_incarnation),
        )
        self.bus.subscribe(self._on_message)
        self.bus.start()
        plan_path = env.get(ENV["inject"])
        plan = FaultPlan.load(plan_path) if plan_path else FaultPlan(faults=())
        self.injector = Injector(
            plan, self.fft_rank, int(env.get(ENV["life"], "0")), executor=self._inject
        )
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
        self._told = True
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
        self._hb.tracking = self._hb.tracking or ok
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

    # --- quorum leases (docs/architecture.md, "Quorum leases") -------------------------------
    def _begin_attempt(self) -> None:
        """A step's attempt starts: its quorum is not known yet."""
        with self._fft_lock:
            self._members = None
            self._leased_step = None
            self._told = False
            self._asked_step = None

    def _end_attempt(self, ok: bool) -> None:
        """The attempt committed (torchft's step already counts it) or rolled back."""
        with self._fft_lock:
            if not ok:
                self._lease = None
            elif self._leased_step is None:  # asked the lighthouse: its quorum, if eligible
                self._lease = None
                if self._candidate is not None:
                    quorum, members, asked_at = self._candidate
                    if asked_at == self._breaks:
                        self._lease = _Lease(quorum, members)
            self._candidate = None
            self._leased_step = None
            self._asked_step = None
            told, self._told = self._told, True
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
        if self.events is not None:
            self.events.close()

    # --- the bus ---------------------------------------------------------------------------
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
                    self._gone.add(m.sender)
                # It took part in every step before m.step: a leased step past that one
                # waits for it in vain; an earlier one completes as it is.
                self._break_lease(m.sender, "left", m, void_from=m.step)
            return
        if isinstance(m, ProcessExited):
            who, why = (m.exited_rank, m.exited_incarnation), "exited"
        elif isinstance(m, HangSuspected):
            who, why = (m.hung_rank, m.hung_incarnation), "stopped" if m.stopped else "hung"
        elif isinstance(m, Fault):
            who, why = (m.faulty_rank, m.faulty_incarnation), m.cause
        else:
            return
        if who == me or who[0] < 0:
            return
        report = m if isinstance(m, Fault) and m.severity is Severity.FAULT2 else None
        clean_exit = isinstance(m, ProcessExited) and m.exit_code == 0
        with self._fft_lock:
            news = report is not None or (who not in self._dead and who not in self._gone)
            if report is None:
                self._dead.add(who)
        # A replica that ended its loop cleanly had finished its collectives of the step
        # (it committed it), and one that announced leaving was handled then.
        if news and self._break_lease(who, why, m, void_from=None if clean_exit else 0):
            return
        if report is not None and not self._about_this_attempt(report):
            return
        with self._fft_lock:
            if clean_exit:
                # The lighthouse leaves it out of the next quorum, and the step in flight
                # here completes as it is.
                return
            members = self._members
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
        """Something the lease did not foresee was told (a fault, a death, a join, a
        member leaving): no step reuses a quorum from before it, and a leased step in
        flight at or past ``void_from`` is voided (None: none is; a join, or a member that
        took part in all of it). Every replica hears the same message, so every one that might
        reuse the lease either did not yet (it asks the lighthouse) or is inside a leased
        step (voided here): none waits in a collective for a peer that went to the
        lighthouse. Whether the message concerns this replica's quorum is deliberately not
        asked: replicas can differ in what they know of the quorum at that moment. True if
        the step in flight was voided."""
        with self._fft_lock:
            self._breaks += 1
            self._lease = None
            leased = self._leased_step
            void = void_from is not None and leased is not None and leased >= void_from
        if void:
            self._fail_step(who, why, m)
        return void

    def _on_waiting(self, m: RollbackRequest) -> None:
        """A member of the last quorum waits in the lighthouse for step ``m.step`` (the
        lighthouse tells, once per quorum): its peers must ask too. A leased step at or
        past ``m.step`` cannot complete (that member is in none of its collectives) and is
        voided; an earlier one can (the member took part in all of it), so it completes
        and the next step asks. An attempt that asked already is where it should be:
        nothing changes, so a quorum whose members ask a moment apart is still leased."""
        with self._fft_lock:
            if self._asked_step is not None:  # asking already
                return
            self._lease = None
            void = self._leased_step is not None and self._leased_step >= m.step
        if void and self.errored() is None:  # (not yet voided by the fault that caused it)
            self._fail_step(m.sender, "waiting in the lighthouse", m)

    def _reuse_quorum(self) -> Any | None:
        """The quorum of this step if it may reuse the lease (torchft's quorum thread)."""
        with self._fft_lock:
            lease = self._lease
            step = self._step
            if lease is None or step % self.quorum_every == 0 or lease.members & self._dead:
                self._asked_at = self._breaks
                self._asked_step = step
                return None
            self._members = set(lease.members)
            self._leased_step = step
            self.quorums_reused += 1
        return _Reused(lease.quorum, step)

    def _fail_step(self, who: tuple[int, int], why: str, m: Message | None) -> None:
        exc = PeerFailed(f"replica rank {who[0]} (incarnation {who[1]}): {why}")
        self.peer_faults += 1
        # The next quorum reconfigures the process group, abandoning collectives that may
        # be stuck on the peer (torchft's own works included, not only those we wait on):
        # their destructors at interpreter exit can abort the process after the job is
        # done (seen: SIGABRT, "terminate called without an active exception").
        exit_without_destructors_later()
        self._told = True
        super().report_error(exc)
        n = self._pending.fail_all(exc)
        self._pg.abort()  # NCCL only (see _BusProcessGroup.abort)
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
            self._members = members
            dead = members & self._dead
            reported, self._reported = self._reported, []
            eligible = self.quorum_every > 1 and not dead and _lease_eligible(q)
            self._candidate = (q, frozenset(members), self._asked_at) if eligible else None
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
        except Exception:  # noqa: BLE001
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
