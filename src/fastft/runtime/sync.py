"""How the replica groups sync (``--sync``): ``per-step``, ``every-k:N``, ``diloco:N``.

- ``per-step`` (HSDP, DDP): every step averages its gradients over the groups.
- ``every-k:N`` (LocalSGD): the groups step on their own gradients; every N-th step
  (N-1, 2N-1, ...) averages the gradients, and starts from the groups' averaged
  parameters and optimizer state, held aside and applied at its commit
  (:meth:`StateRegistry.hold_average`).
- ``diloco:N`` (DiLoCo, Douillard et al. 2023): the groups step on their own gradients
  with their own (inner) optimizer; on entering every N-th step (N, 2N, ...) each group's
  *pseudo-gradient*, the anchor (the parameters of the last outer step) minus its
  parameters, is averaged over the groups, an outer optimizer (Nesterov SGD, lr 0.7,
  momentum 0.9 by default) steps the anchor with it, and every group continues from the
  new anchor. The outer step belongs to the transaction of the step it begins: a rollback
  of that step undoes it (:class:`Outer`), a commit keeps it.

The averages run on this member's local shards with shard groups (each shard index over
its replicate group), on the whole model without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastft.interrupt import allreduce as interruptible_allreduce
from fastft.runtime.state.outer import Outer, OuterOptimizer, default_outer_optimizer
from fastft.runtime.state.wire import flatten, unflatten

if TYPE_CHECKING:
    from fastft.runtime.ports import RuntimePorts

__all__ = [
    "Outer",
    "OuterOptimizer",
    "default_outer_optimizer",
    "outer_due",
    "outer_step",
    "reduce_flat",
    "reduce_gradients",
]


def reduce_gradients(rt: RuntimePorts) -> None:
    """``tx.allreduce_gradients()`` under the job's sync policy (interruptible)."""
    cfg, x, registry = rt.config, rt.engine, rt.registry
    every = cfg.sync_every
    buffers = registry.float_buffers() if cfg.buffers == "average" and not rt.sharded else []
    # the bucket's tail carries the buffers (and their weight) in the same collective, its
    # slots the step's vote (fastft.runtime.state.inband): the agreement needs no allreduce then
    vote = rt.vote
    # (built on first use: backward accumulates into it)
    whole = registry.grad_bucket(buffers, vote.slots())
    if cfg.sync_kind == "diloco" or (every > 1 and (x.state.step + 1) % every):
        return  # a local step (FSDP averaged the group's shards already)
    grads: list[torch.Tensor] = []
    tail = registry.bucket_tail
    slots = registry.bucket.slots if whole is not None else None
    flat = registry.bucket.reduced  # (the gradients and the tail: weighed and averaged)
    if whole is None or flat is None:  # mixed dtypes or devices, or FSDP's shards: a copy
        grads = registry.gradients()
        whole = flat = flatten(grads)
        tail = None
    voted = vote.carry(slots)
    if buffers and tail is not None:
        tail[:-1].copy_(flatten(buffers))
        tail[-1] = 1.0
    kept = x.kept
    if not rt.sharded:  # (FSDP averaged a shard group's gradients with equal weights)
        kept.weigh(flat, x.state.step)
    groups = rt.world // cfg.shard_size
    if buffers and tail is None:
        _allreduce_with_buffers(rt, flat, buffers)
    else:
        _allreduce(rt, whole)
    if voted:
        assert slots is not None
        vote.carried(slots)
    if buffers and tail is not None:
        _set_buffers(buffers, tail)
    if kept.share is None or rt.sharded:
        flat.div_(groups)
    if grads:
        unflat = unflatten(flat, grads)
        for g, r in zip(grads, unflat, strict=True):
            g.copy_(r)
    if every > 1:  # a sync step starts from the groups' average, applied at its commit
        held = registry.sync_tensors()
        avg = flatten(held)
        _allreduce(rt, avg)
        avg.div_(groups)
        registry.hold_average(held, unflatten(avg, held))


def reduce_flat(rt: RuntimePorts, flat: torch.Tensor, slots: int = 0) -> None:
    """A gradient that is not a registered model's (``fastft.jax``'s, in one flat buffer)
    averaged in place over the epoch as :func:`reduce_gradients` averages a model's:
    weighed by this member's share when the step used ``tx.shard`` (and, in an elastic
    world, kept for a retry), summed (interruptible), divided by the members otherwise.
    Its last ``slots`` elements carry the step's vote (:mod:`.state.inband`), neither
    weighed nor averaged. Per-step sync without shard groups only."""
    cfg, x = rt.config, rt.engine
    if cfg.sync_kind != "per-step" or cfg.shard_size > 1:
        raise RuntimeError(
            f"--sync {cfg.sync} / --shard-size {cfg.shard_size}: a gradient that is not a "
            "registered torch model's is averaged at every step over every member "
            "(--sync per-step, --shard-size 1)"
        )
    body, tail = (flat[:-slots], flat[-slots:]) if slots else (flat, None)
    voted = rt.vote.carry(tail)
    x.kept.weigh(body, x.state.step)
    _allreduce(rt, flat)
    if voted:
        assert tail is not None
        rt.vote.carried(tail)
    if x.kept.share is None:
        body.div_(rt.world)


def outer_due(rt: RuntimePorts, step: int) -> bool:
    """Whether ``step`` begins with DiLoCo's outer step (N, 2N, ...)."""
    cfg = rt.config
    return cfg.sync_kind == "diloco" and step > 0 and step % cfg.sync_every == 0


def outer_step(rt: RuntimePorts) -> None:
    """DiLoCo's outer step, at the start of a step's attempt (interruptible)."""
    outer = rt.registry.outer
    assert outer is not None
    delta = outer.pseudo_gradient()
    _allreduce(rt, delta)
    delta.div_(rt.world // rt.config.shard_size)
    outer.step(delta)


def _set_buffers(buffers: list[torch.Tensor], summed: torch.Tensor) -> None:
    """``--buffers average``: the model's floating buffers (BatchNorm's running statistics)
    ride the gradients' allreduce, in the bucket's tail, weighed as the gradients are (by
    each member's share of the step's samples, kept parts included) with the weights'
    sum last: their weighted mean is what one model that saw the whole global batch would
    hold (exactly for a running mean; for a running variance, the members' mean), the
    same on every member. It costs bytes in a collective the step makes anyway."""
    values = unflatten(summed[:-1] / summed[-1:], buffers)
    with torch.no_grad():
        for b, v in zip(buffers, values, strict=True):
            b.copy_(v)


def _allreduce_with_buffers(
    rt: RuntimePorts, flat: torch.Tensor, buffers: list[torch.Tensor]
) -> None:
    """:func:`_set_buffers` where the gradients have no bucket (mixed dtypes): a second
    allreduce of the buffers, weighed by this member's share."""
    share = rt.engine.kept.share
    weight = (share[1] - share[0]) / share[2] if share is not None else 1.0
    one = torch.ones(1, dtype=buffers[0].dtype, device=buffers[0].device)
    carried = flatten([*buffers, one]).mul_(weight)
    _allreduce(rt, flat)
    _allreduce(rt, carried)
    _set_buffers(buffers, carried)


def _allreduce(rt: RuntimePorts, flat: torch.Tensor) -> None:
    pg = rt.require_pg()
    with rt.heartbeat.blocked:
        interruptible_allreduce(pg, [flat], rt.interrupter)
