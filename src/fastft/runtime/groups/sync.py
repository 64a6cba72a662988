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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fastft.interrupt import allreduce as interruptible_allreduce
from fastft.runtime.state.wire import _clone

if TYPE_CHECKING:
    from fastft.runtime.api import Runtime

__all__ = [
    "Outer",
    "OuterOptimizer",
    "default_outer_optimizer",
    "outer_due",
    "outer_step",
    "reduce_gradients",
]

OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the anchor's tensors (``diloco``)."""


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class Outer:
    """DiLoCo's outer state: the anchor (the parameters every group started the window
    from) and the outer optimizer over it. Equal on every replica group after every
    commit; a heal sends it, the digest covers it, the durable tier saves it.

    ``params``: this member's parameters (its local shards with FSDP2) as tensors whose
    storage is the parameters' own, so a copy into them sets the parameters."""

    def __init__(self, params: list[torch.Tensor], make: OuterOptimizer | None = None) -> None:
        if not params:
            raise ValueError("diloco: the registered model has no parameters")
        self.params = params
        self.anchor = [p.detach().clone() for p in params]
        self.optimizer = (make or default_outer_optimizer)(self.anchor)
        self._undo: tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]] | None = None

    def pseudo_gradient(self) -> torch.Tensor:
        """This group's move since the anchor, flat: anchor - parameters."""
        return torch._utils._flatten_dense_tensors(
            [a - p.detach() for a, p in zip(self.anchor, self.params, strict=True)]
        )

    @torch.no_grad()
    def step(self, average: torch.Tensor) -> None:
        """The outer step on the pseudo-gradient averaged over the groups; the parameters
        become the new anchor. Undone by :meth:`rollback` until :meth:`committed`."""
        assert self._undo is None, "an outer step neither committed nor rolled back"
        self._undo = (
            [p.detach().clone() for p in self.params],
            [a.clone() for a in self.anchor],
            _clone(self.optimizer.state_dict()),
        )
        grads = torch._utils._unflatten_dense_tensors(average, self.anchor)
        for a, g in zip(self.anchor, grads, strict=True):
            a.grad = g
        self.optimizer.step()
        for a, p in zip(self.anchor, self.params, strict=True):
            a.grad = None
            p.copy_(a)

    def committed(self) -> None:
        self._undo = None

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo an outer step whose transaction did not commit."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        params, anchor, state = undo
        for p, saved in zip(self.params, params, strict=True):
            p.copy_(saved)
        for a, saved in zip(self.anchor, anchor, strict=True):
            a.copy_(saved)
        self.optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": list(self.anchor), "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        anchor = state["anchor"]
        if len(anchor) != len(self.anchor):
            raise ValueError(f"diloco: {len(anchor)} anchor tensors for {len(self.anchor)}")
        for a, saved in zip(self.anchor, anchor, strict=True):
            a.copy_(saved)
        self.optimizer.load_state_dict(_clone(state["optimizer"]))
        self._undo = None

    def tensors(self) -> list[torch.Tensor]:
        """What the digest hashes: the anchor, then the outer optimizer's tensors."""
        out = list(self.anchor)
        for st in self.optimizer.state_dict()["state"].values():
            out += [t for _, t in sorted(st.items()) if isinstance(t, torch.Tensor)]
        return out


def reduce_gradients(rt: Runtime) -> None:
    """``tx.allreduce_gradients()`` under the job's sync policy (interruptible)."""
    cfg, x, registry = rt.config, rt._x, rt.registry
    every = cfg.sync_every
    flat = registry.grad_bucket()  # (built on first use: backward accumulates into it)
    if cfg.sync_kind == "diloco" or (every > 1 and (x.state.step + 1) % every):
        return  # a local step (FSDP averaged the group's shards already)
    grads: list[torch.Tensor] = []
    if flat is None:  # mixed dtypes or devices, or FSDP's shards: flatten a copy
        grads = registry.gradients()
        flat = torch._utils._flatten_dense_tensors(grads)
    kept = x.kept
    if not rt.sharded:  # (FSDP averaged a shard group's gradients with equal weights)
        kept.weigh(flat, x.state.step)
    groups = rt.world // cfg.shard_size
    _allreduce(rt, flat)
    if kept.share is None or rt.sharded:
        flat.div_(groups)
    if grads:
        unflat = torch._utils._unflatten_dense_tensors(flat, grads)
        for g, r in zip(grads, unflat, strict=True):
            g.copy_(r)
    if every > 1:  # a sync step starts from the groups' average, applied at its commit
        held = registry.sync_tensors()
        avg = torch._utils._flatten_dense_tensors(held)
        _allreduce(rt, avg)
        avg.div_(groups)
        registry.hold_average(held, torch._utils._unflatten_dense_tensors(avg, held))


def outer_due(rt: Runtime, step: int) -> bool:
    """Whether ``step`` begins with DiLoCo's outer step (N, 2N, ...)."""
    cfg = rt.config
    return cfg.sync_kind == "diloco" and step > 0 and step % cfg.sync_every == 0


def outer_step(rt: Runtime) -> None:
    """DiLoCo's outer step, at the start of a step's attempt (interruptible)."""
    outer = rt.registry.outer
    assert outer is not None
    delta = outer.pseudo_gradient()
    _allreduce(rt, delta)
    delta.div_(rt.world // rt.config.shard_size)
    outer.step(delta)


def _allreduce(rt: Runtime, flat: torch.Tensor) -> None:
    pg = rt._require_pg()
    with rt._hb.blocked:
        interruptible_allreduce(pg, [flat], rt.interrupter)
