"""The replica check in the simulator (issue 50): every step, the members compare the
states they reached the step's collective with (their hashes; a ``bitflip`` marks one
``~``), and repair a mismatch with the real decision
(:func:`fastft.runtime.state.compare.repair`): the minority declares its state lost and
heals from a member of the majority, the step runs again without one, the durable tier
restores, or the job stops. What the simulator then checks: a member found corrupted
never serves a heal and never votes or commits again before it healed."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from fastft.protocol import Severity
from fastft.protocol.exits import EXIT_REPLICAS_DIVERGED
from fastft.runtime.contract import EpochView
from fastft.runtime.state.compare import repair, verdict
from fastft.sim.faults import corruption
from fastft.sim.waits import Ended

__all__ = ["compare"]


def compare(life: Any, key: tuple[int, int], view: EpochView, gen: int) -> str | None:
    """The check of step ``key`` (epoch, step) for ``life`` (a :class:`~fastft.sim.life.
    Life`, which imports this module): None (the replicas agree),
    ``"vote"`` (this member goes on, its step not decided by the collective: a minority's
    fault rolls it back) or ``"fault"`` (this member reported a fault: it drives again)."""
    w = life.w
    snap = w.snapshots.get(key, {})
    rows: dict[int, Sequence[int]] = {
        m.rank: [0, int(hashlib.sha1(snap[m].encode()).hexdigest()[:12], 16)]
        for m in view.members
        if m in snap
    }
    if len(rows) < 2 or len({tuple(r) for r in rows.values()}) == 1:
        return None
    step = key[1]
    v = verdict(step, key[0], ["state"], rows)
    do = repair(
        v,
        step=step,
        healed=life.healed,
        retried=life.retried,
        durable=bool(w.opts.checkpoint_every),
        fresh=step - view.step < 2 and bool(view.needs_state),
    )
    w.trace(life, f"replica check of step {step}: {do.action} (minority {list(v.minority)})")
    if do.action == "stop":
        raise Ended(EXIT_REPLICAS_DIVERGED, do.why)
    if do.action == "heal":
        life.healed[v.items] = step
        if life.rank not in v.minority:
            return "vote"
        flip = corruption(snap.get(life.me, ""))
        if flip is not None:
            w.known_corrupt.add(flip)
    elif do.action == "retry":
        life.retried = (step, v.items)
        life.local_fault(Severity.FAULT2, "ReplicaMismatch: no majority", gen)
        return "fault"
    life.h = f"lost@{w.now:.6f}"  # (heal: the minority's; restore: every member's)
    life.local_fault(Severity.FAULT1, "StateLostFault: the replica check", gen)
    return "fault"
