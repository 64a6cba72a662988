"""The data plane of one worker: each epoch's process group, the heal group beside it,
and the backend choice. Groups abandoned with an operation in flight are kept, never
destroyed and never reused (their destructor would wait for a dead peer)."""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastft.process.events import EventLog
from fastft.process.teardown import drop_later, keep_at_exit, keep_forever
from fastft.runtime.contract import EpochView, choose_backend
from fastft.runtime.groups.hsdp import StepGate, heal_group, replicate_ranks

__all__ = ["DataPlane", "HealTail"]

log = logging.getLogger(__name__)

_WAIT_S = 0.05


@dataclass
class HealTail:
    """The deferred part of a heal (:mod:`fastft.runtime.state.heal`): the optimizer state's
    works, started when the rest was in, and what loading it needs."""

    epoch: int
    header: bytes
    flats: list[torch.Tensor]
    works: list[Any]
    receiving: bool
    started: float


class DataPlane:
    def __init__(
        self,
        store: dist.Store,
        *,
        backend: str,
        pg_timeout_s: float,
        model: Callable[[], nn.Module | None],
        events: EventLog,
        shard_size: int = 1,
    ) -> None:
        self._store = store
        self.k = shard_size
        """Workers per shard group: the epoch's group is then this member's replicate group
        (:mod:`fastft.runtime.groups.hsdp`)."""
        self.gate: StepGate | None = None
        """The shard group's step gate, once the group has met (:meth:`Runtime.shard_mesh`)."""
        self._build_client: Any = None  # made by the first build, on its thread
        self._abandoned = 0
        """The store client of group builds: not the main thread's (a build waiting for a
        dead peer's key holds a client for up to the timeout, and the main thread's
        formation would queue behind it); replaced after a build is abandoned."""
        self._configured = backend
        self._timeout = datetime.timedelta(seconds=pg_timeout_s)
        self._model = model
        self._events = events
        self._chosen: str | None = None
        self.pg: Any = None
        self.pg_epoch = -1
        self.heal_pg: tuple[int, Any] | None = None
        """(epoch, group) of the source and the members it heals (:meth:`heal_ranks`)."""
        self.heal_tail: HealTail | None = None
        """The optimizer state of this epoch's heal, still in transit while the step runs
        (sent or received over the heal group): finished before the vote."""
        keep_at_exit(lambda: (self.pg, self.heal_pg[1] if self.heal_pg else None))

    # --- the backend -----------------------------------------------------------------------
    def backend(self) -> str:
        """The configured backend; ``auto`` is decided once, at ``register(model=...)`` (or
        at the first process group when no model is registered), from where the model
        lives (:func:`choose_backend`)."""
        if self._chosen is None:
            model = self._model()
            devices = {p.device.type for p in model.parameters()} if model is not None else set()
            self._chosen, why = choose_backend(
                self._configured,
                devices,
                local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                gpus=torch.cuda.device_count() if "cuda" in devices else 0,
            )
            if why:
                log.warning("backend: %s", why)
        return self._chosen

    def gpu(self) -> torch.device | None:
        """The GPU of the registered model, None if it has none."""
        model = self._model()
        for p in model.parameters() if model is not None else ():
            if p.device.type == "cuda":
                return p.device
        return None

    def comm_device(self) -> torch.device:
        """Where this epoch's collectives take tensors: NCCL needs them on the model's GPU."""
        if self.backend() == "nccl":  # pragma: no cover - GPU machines only
            return self.gpu() or torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def heal_apart(self) -> bool:
        """Whether a heal runs in a group of its own (the source and the members it heals)
        while the other members go on with the step. On Gloo, where a group is cheap and
        the other members would otherwise receive the whole state for nothing (and take
        CPU from the two that need it). On NCCL a communicator is expensive, so the heal
        stays one broadcast over the epoch's group. Shard groups heal apart always: one
        group per shard index, all at once."""
        return self.k > 1 or self.backend() != "nccl"

    def heal_ranks(self, view: EpochView, rank: int) -> list[int] | None:
        """The heal group of ``view`` (source first) when ``rank`` is in one."""
        if not self.heal_apart():
            return None
        return heal_group(view, rank, self.k)

    def group_ranks(self, view: EpochView, rank: int) -> list[int]:
        """The members of ``rank``'s epoch group: all of them, or with shard groups the
        members of its shard index (:func:`replicate_ranks`)."""
        return replicate_ranks(view, rank, self.k)

    # --- the step's gate and the heal's tail: set here only ------------------------------
    def set_gate(self, gate: StepGate) -> None:
        """Shard groups: the gate a group's members cross together into each step."""
        self.gate = gate

    def hold_tail(self, tail: HealTail) -> bool:
        """Keep ``tail`` (finished before the vote), unless its epoch's heal group was
        released meanwhile (a fault ended the epoch): then False."""
        if self.heal_pg is None or self.heal_pg[0] != tail.epoch:
            return False
        self.heal_tail = tail
        return True

    def drop_tail(self, tail: HealTail) -> bool:
        """``tail`` is finished: forget it; False if it was released meanwhile."""
        if self.heal_tail is not tail:
            return False
        self.heal_tail = None
        return True

    # --- groups ----------------------------------------------------------------------------
    def abort(self, epoch: int) -> None:
        """The epoch ends with an operation perhaps in flight: abandon its groups."""
        self.release_heal(pending=True)
        if self.pg is not None:
            keep_forever(self.pg)  # never destroyed mid-operation, never reused
            if hasattr(self.pg, "abort") and self.backend() == "nccl":
                self._abort_nccl(self.pg, epoch)
            self.pg = None

    def release_heal(self, *, pending: bool) -> None:
        """Let the heal group go: kept, never destroyed, when an operation may still be
        pending on it (as an abandoned epoch group); else destroyed off the main thread."""
        if self.heal_pg is None:
            return
        held = [self.heal_pg[1]]
        self.heal_pg = None
        self.heal_tail = None  # abandoned with it, or already finished
        if pending:
            keep_forever(held[0])
        else:
            drop_later(held)

    def configure(
        self, view: EpochView, rank: int, prefix: str, cancelled: Callable[[], bool]
    ) -> bool:
        """Build ``view``'s group (and its heal group, when ``rank`` is in one) and make
        it current. False if ``cancelled()`` first; raises what a build raised."""
        t0 = time.monotonic()
        ranks = self.group_ranks(view, rank)
        size = len(ranks)
        name = f"fastft-pg-{view.epoch}"
        part = f"{rank % self.k}/" if self.k > 1 else ""  # one group per shard index
        futs = [self._build(prefix + part, ranks.index(rank), size, name)]
        heal = self.heal_ranks(view, rank)
        if heal is not None:  # built alongside, not after: the heal waits for both
            futs.append(
                self._build(
                    f"{prefix}heal/{part}",
                    heal.index(rank),
                    len(heal),
                    name + "-heal",
                    own_store=True,
                )
            )
        groups: list[Any] = []
        for fut in futs:
            while True:
                try:
                    groups.append(fut.result(timeout=_WAIT_S))
                    break
                except cf.TimeoutError:
                    if cancelled():
                        _keep_all(groups, futs)
                        self._build_client = None  # it may be blocked: the next build's own
                        self._abandoned += 1
                        return False
                except Exception:
                    _keep_all(groups, futs)
                    self._build_client = None
                    self._abandoned += 1
                    raise
        if self.pg is not None:  # the last epoch's, after a commit: nothing is pending
            done = [self.pg]
            self.pg = None
            drop_later(done)
        self.pg, self.pg_epoch = groups[0], view.epoch
        self.heal_pg = (view.epoch, groups[1]) if heal is not None else None
        self._events.emit(
            "process_group",
            epoch=view.epoch,
            backend=self.backend(),
            size=size,
            build_ms=round((time.monotonic() - t0) * 1e3, 3),
            **({"heal_group": heal} if heal is not None else {}),
        )
        return True

    def _build(
        self, prefix: str, rank: int, size: int, name: str, *, own_store: bool = False
    ) -> cf.Future[Any]:
        """Build a process group in a daemon thread: connecting to a member that died
        meanwhile blocks in C++ until the timeout, and the death must be able to cancel
        the wait. ``own_store``: over a connection of its own, for a group built while
        another is: a store client serialises its requests, so one group's blocking
        ``get`` would hold back the other's ``set`` that a peer waits for (a deadlock
        until the timeout)."""
        timeout = self._timeout
        backend = self.backend()
        fut: cf.Future[Any] = cf.Future()
        shared = None if own_store else self._build_client
        abandoned = self._abandoned

        def run() -> None:
            try:
                client = shared
                if client is None:  # (a connection of its own, or after an abandoned build)
                    client = self._store.clone()  # type: ignore[attr-defined]
                    if not own_store and self._abandoned == abandoned:
                        self._build_client = client
                store = dist.PrefixStore(prefix, client)
                if backend == "nccl":  # pragma: no cover - checked on a GPU machine only
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = timeout  # noqa: SLF001 - torch's ProcessGroupNCCL.Options field
                    fut.set_result(dist.ProcessGroupNCCL(store, rank, size, opts))
                else:
                    fut.set_result(dist.ProcessGroupGloo(store, rank, size, timeout))
            except BaseException as e:
                fut.set_exception(e)

        threading.Thread(target=run, name=name, daemon=True).start()
        return fut

    def _abort_nccl(self, pg: Any, epoch: int) -> None:  # pragma: no cover - NCCL only
        """Abort an abandoned NCCL communicator, off the state machine's lock: the abort
        releases a collective stuck on a dead peer, but it also waits for the kernels
        queued before that collective on the GPU, which can take long. The next epoch
        builds a new communicator meanwhile."""

        def run() -> None:
            t0 = time.monotonic()
            try:
                pg.abort()
            except Exception:
                log.exception("process group abort failed")
            self._events.emit(
                "pg_abort", epoch=epoch, abort_ms=round((time.monotonic() - t0) * 1e3, 3)
            )

        threading.Thread(target=run, name=f"fastft-nccl-abort-{epoch}", daemon=True).start()


def _keep_all(groups: list[Any], futs: list[cf.Future[Any]]) -> None:
    """A build given up: the groups built so far, and those a build thread still makes,
    are never destroyed (a peer may be connecting to them, or gone)."""
    for g in groups:
        keep_forever(g)

    def keep(f: cf.Future[Any]) -> None:
        if f.exception() is None:
            keep_forever(f.result())

    for f in futs:
        f.add_done_callback(keep)
