"""The step engine built whole: the executor and every part it owns, each given what it
needs at construction (nothing is wired afterwards)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fastft.interrupt import Interrupter
from fastft.process.events import EventLog
from fastft.protocol import JobKeys
from fastft.runtime.contract import Member, RuntimeConfig
from fastft.runtime.durable.checkpoints import Checkpoints
from fastft.runtime.engine.coordinator import Coordinator
from fastft.runtime.engine.executor import EngineParts, Executor
from fastft.runtime.engine.formation import Recovery
from fastft.runtime.engine.sideclient import SideClient
from fastft.runtime.groups.dataplane import DataPlane
from fastft.runtime.groups.flow import Flow
from fastft.runtime.state.kept import KeptGradients
from fastft.runtime.state.registry import StateRegistry

__all__ = ["build_engine"]


def build_engine(
    config: RuntimeConfig,
    me: Member,
    keys: JobKeys,
    store: dist.Store,
    control: Any,
    decisions: Any,
    registry: StateRegistry,
    interrupter: Interrupter,
    events: EventLog,
    flow: Flow | None,
) -> Executor:
    """The step engine and the parts it owns, each built with what it needs: the
    coordinator over the (signed) control store, the listener's side client, the data
    plane over the raw store, kept gradients, the durable tier; the worker's one set of the
    dead, which the executor writes and the coordinator reads."""
    durable = (
        Checkpoints(config.checkpoint_dir, config.checkpoint_keep, events)
        if config.checkpoint_dir
        else None
    )

    def recovery() -> Recovery:
        saved = durable.latest() if durable is not None else None
        return Recovery(saved.step if saved else None, config.allow_fresh_start, registry.resume)

    dead: set[Member] = set()
    coordinator = Coordinator(
        control,
        keys,
        me.rank,
        me.incarnation,
        config.world_size,
        config.min_members,
        dead=dead,
        decision_store=decisions,
        recovery=recovery,
        shard_size=config.shard_size,
    )
    dataplane = DataPlane(
        store,
        backend=config.backend,
        pg_timeout_s=config.pg_timeout_s,
        model=lambda: registry.model,
        events=events,
        shard_size=config.shard_size,
    )
    # (not with shard groups: FSDP averaged a group's parts already; not with local
    # steps, which reduce no gradients)
    kept = KeptGradients(
        config.keep_gradients
        and config.elastic
        and config.shard_size == 1
        and config.sync == "per-step"
    )
    parts = EngineParts(
        coordinator,
        SideClient(control.clone(), keys),
        registry,
        interrupter,
        events,
        dataplane,
        kept,
        durable,
        after_commit=flow.committed if flow is not None else None,
    )
    return Executor(config, me, parts, dead)
