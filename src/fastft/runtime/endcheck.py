"""The replicas compared once more at the job's end (issue 61).

The in-band check compares the state each checked step *began* with: a divergence after
the last check (a member's state changed by the script's code after the last commit, a
bit flipped late) was never compared, and the job ended 0 with different replicas. When a
member closes after its last committed step, it writes its checksums of every registered
item (:func:`fastft.runtime.state.compare.row`) to the store, waits up to
:data:`END_WAIT_S` for every member of its epoch to write theirs, and compares them
(:func:`~fastft.runtime.state.compare.verdict`): a difference ends the worker with exit 94
naming the item and the members, as the in-band check does. Skipped, saying so, when a
member does not write in time (it died after the last commit), and where the in-band check
is off (``--compare-every 0``, one member, shard groups, local steps)."""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

from fastft.runtime.endings import ReplicasDiverged
from fastft.runtime.state.compare import checksums, replica_items, row, verdict

__all__ = ["END_WAIT_S", "end_check"]

log = logging.getLogger(__name__)

END_WAIT_S = 10.0
"""How long a member waits at the job's end for the others' checksums."""


def end_check(rt: Any, store: Any) -> None:
    """Compare the replicas after the last commit (see the module; ``rt``: the
    :class:`~fastft.runtime.api.Runtime` closing); raises
    :class:`ReplicasDiverged` if they differ."""
    x, cfg = rt.engine, rt.config
    view = x.view
    if view is None or len(view.members) < 2 or not cfg.compare_every or rt.sharded:
        return
    if cfg.sync_kind != "per-step":
        return  # (the parameters are each replica group's own between syncs)
    step = x.state.step
    sums = checksums(replica_items(rt.registry, replicated=True, local_steps=False))
    keys = [rt.keys.end_sums(view.epoch, step, m.rank) for m in view.members]
    try:
        store.set(rt.keys.end_sums(view.epoch, step, rt.rank), json.dumps(row(sums)))
        store.wait(keys, datetime.timedelta(seconds=END_WAIT_S))
        got = store.multi_get(keys)
    except Exception as e:  # (a member gone after the last commit; the store at its end)
        log.warning("the replicas were not compared at the job's end: %s", e)
        rt.events.emit("end_check", step=step, compared=False, why=str(e)[:200])
        return
    rows = {m.rank: json.loads(bytes(v)) for m, v in zip(view.members, got, strict=True)}
    v = verdict(step, view.epoch, [n for n, _ in sums], rows)
    rt.events.emit("end_check", step=step, compared=True, items=list(v.items))
    if not v.items:
        return
    why = (
        f"at the job's end, after the commit of step {step - 1}: "
        f"{v.message.replace(f'at the start of step {step} ', '')}. The job ends with "
        "exit 94 rather than leave different replicas (the check at the job's end)"
    )
    rt.events.emit(
        "replicas_diverged",
        epoch=view.epoch,
        step=step,
        items=list(v.items),
        minority=list(v.minority),
        action="stop",
        error=v.message,
        repair="the job's end",
    )
    log.critical("%s", why)
    raise ReplicasDiverged(why)
