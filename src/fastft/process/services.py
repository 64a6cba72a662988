"""The per-process services of one worker life, shared by the native runtime and
``ManagerFFT``: the event log, the heartbeat, the exit sentinel, the stack dump on the
agent's signal, the bus endpoint and the fault injector.

Started in one call, last in the owner's constructor (the bus delivers messages to the
owner's callback from then on), and closed in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from fastft.bus import BusConfig, BusEndpoint, open_bus
from fastft.inject import FaultPlan, FaultSpec, Injector
from fastft.process.env import insecure
from fastft.process.events import EventLog
from fastft.process.heartbeat import HeartbeatWriter, dump_stacks_on_signal
from fastft.process.sentinel import start_exit_sentinel
from fastft.protocol import Inject, Message
from fastft.protocol.auth import JobSecret

__all__ = ["Services"]


@dataclass
class Services:
    events: EventLog
    heartbeat: HeartbeatWriter
    bus: BusEndpoint
    injector: Injector

    @classmethod
    def start(
        cls,
        *,
        store: dist.Store,
        job: str,
        rank: int,
        incarnation: int,
        life: int,
        label: str,
        run_dir: str | None,
        heartbeat_file: str | None,
        exit_trace_file: str | None,
        inject: str | None,
        on_message: Callable[[Message], None],
        fire: Callable[[FaultSpec], None],
        secret_file: str | None,
        events: EventLog | None = None,
    ) -> Services:
        """``on_message``: the owner's callback for every bus message but a live fault
        injection (``fastft inject``), which the injector takes;
        ``fire``: how the owner executes a planned fault (it logs it first);
        ``secret_file``: the job secret (required: ConfigError without);
        ``events``: an event log the owner opened already."""
        secret = None if insecure() else JobSecret.for_worker(secret_file)
        events = events if events is not None else EventLog(run_dir, label)
        heartbeat = HeartbeatWriter(heartbeat_file)
        start_exit_sentinel(exit_trace_file)
        dump_stacks_on_signal()
        plan = FaultPlan.load(inject) if inject else FaultPlan(faults=())
        injector = Injector(plan, rank, life, executor=fire)
        bus = open_bus(store, BusConfig(job=job, rank=rank, incarnation=incarnation, secret=secret))

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
