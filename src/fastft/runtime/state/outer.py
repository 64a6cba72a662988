"""DiLoCo's outer state (``--sync diloco:N``, :mod:`fastft.runtime.sync`): the
anchor and the outer optimizer, registered state that a rollback undoes, a heal sends and
the durable tier saves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastft.runtime.state.wire import clone, flatten, unflatten

__all__ = ["Outer", "OuterOptimizer", "default_outer_optimizer"]

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
        return flatten([a - p.detach() for a, p in zip(self.anchor, self.params, strict=True)])

    @torch.no_grad()
    def step(self, average: torch.Tensor) -> None:
        """The outer step on the pseudo-gradient averaged over the groups; the parameters
        become the new anchor. Undone by :meth:`rollback` until :meth:`committed`."""
        assert self._undo is None, "an outer step neither committed nor rolled back"
        self._undo = (
            [p.detach().clone() for p in self.params],
            [a.clone() for a in self.anchor],
            clone(self.optimizer.state_dict()),
        )
        grads = unflatten(average, self.anchor)
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
        self.optimizer.load_state_dict(clone(state["optimizer"]))
        self._undo = None

    def tensors(self) -> list[torch.Tensor]:
        """What the digest hashes: the anchor, then the outer optimizer's tensors."""
        out = list(self.anchor)
        for st in self.optimizer.state_dict()["state"].values():
            out += [t for _, t in sorted(st.items()) if isinstance(t, torch.Tensor)]
        return out
