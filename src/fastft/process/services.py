"""The per-process services of one worker life, shared by the native runtime and
``ManagerFFT``: the event log, the heartbeat, the exit sentinel, the stack dump on the
agent's signal, the bus endpoint and the fault injector.

Started in one call, last in the owner's constructor (the bus delivers messages to the
owner's callback from then on), and closed in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from fastft.bus import BusConfig, BusEndpoint, open_bus
from fastft.inject import FaultPlan, FaultSpec, Injector
from fastft.process.env import insecure
from fastft.process.events import EventLog
from fastft.process.heartbeat import HeartbeatWriter, dump_stacks_on_signal
from fastft.process.sentinel import start_exit_sentinel
from fastft.protocol import Inject, Message
from fastft.protocol.auth import JobSecret

__all__ = ["Services", "WorkerLife"]


class WorkerLife(Protocol):
    """What the services of one worker life read of its configuration (a
    ``RuntimeConfig`` and the launcher's ``WorkerEnv`` both are one)."""

    @property
    def job(self) -> str: ...

    @property
    def life(self) -> int | None: ...

    @property
    def run_dir(self) -> str | None: ...

    @property
    def heartbeat_file(self) -> str | None: ...

    @property
    def exit_trace_file(self) -> str | None: ...

    @property
    def inject(self) -> str | None: ...

    @property
    def relay_socket(self) -> str | None: ...

    @property
    def secret_file(self) -> str | None: ...


@dataclass
class Services:
    events: EventLog
    heartbeat: HeartbeatWriter
    bus: BusEndpoint
    injector: Injector

    @classmethod
    def start(
        cls,
        store: dist.Store,
        of: WorkerLife,
        *,
        rank: int,
        incarnation: int,
        label: str,
        on_message: Callable[[Message], None],
        fire: Callable[[FaultSpec], None],
        events: EventLog | None = None,
    ) -> Services:
        """The services of the life ``of`` describes (a ``RuntimeConfig`` or the
        launcher's ``WorkerEnv``: its job, life, run directory, heartbeat and exit-trace
        files, fault plan, job secret (required: ConfigError without) and the node's bus
        relay) as ``rank``'s ``incarnation``. ``on_message``: the owner's callback for
        every bus message but a live fault injection (``fastft inject``), which the
        injector takes; ``fire``: how the owner executes a planned fault (it logs it
        first); ``events``: an event log the owner opened already."""
        secret = None if insecure() else JobSecret.for_worker(of.secret_file)
        events = events if events is not None else EventLog(of.run_dir, label)
        heartbeat = HeartbeatWriter(of.heartbeat_file)
        start_exit_sentinel(of.exit_trace_file)
        dump_stacks_on_signal()
        plan = FaultPlan.load(of.inject) if of.inject else FaultPlan(faults=())
        injector = Injector(plan, rank, of.life or 0, executor=fire, pause=heartbeat.sleep)
        config = BusConfig(job=of.job, rank=rank, incarnation=incarnation, secret=secret)
        bus = open_bus(store, config, relay=of.relay_socket)

        def deliver(m: Message) -> None:
            if isinstance(m, Inject):  # (live `fastft inject`, for every owner alike)
                injector.on_message(m)
            else:
                on_message(m)

        bus.subscribe(deliver)
        bus.start()
        return cls(events, heartbeat, bus, injector)

    def close(self) -> None:
        """Idempotent: each part's close is."""
        self.bus.close()
        self.heartbeat.close()
        self.events.close()
