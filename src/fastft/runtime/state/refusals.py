"""What :meth:`~fastft.runtime.state.registry.StateRegistry.register` refuses, with the
reason and the fix: state a heal cannot send, and a learning-rate scheduler that steps
the registered optimizer without being registered. Refused at ``register``, each would
otherwise surface after a fault: a heal that fails its retries, or a member that trains
at another learning rate than its peers from its restart on."""

from __future__ import annotations

import gc
from typing import Any

import torch

import fastft.runtime.state.tree as tree

__all__ = ["unregistered_scheduler", "unsendable"]


def unsendable(name: str, obj: Any) -> None:
    """A TypeError naming where ``obj.state_dict()`` holds what a heal and a checkpoint
    cannot carry (anything but tensors, JSON values, bytes and NumPy arrays)."""
    tree.dump(obj.state_dict(), [], name)


def unregistered_scheduler(optimizer: torch.optim.Optimizer | None, registered: list[Any]) -> None:
    """A TypeError if a torch scheduler steps ``optimizer`` but neither it nor a registered
    scheduler that holds it (``SequentialLR``, ``ChainedScheduler``) is in ``registered``.
    Found through the optimizer's ``step``, which every torch scheduler wraps, then the
    objects that refer to the optimizer (once, at ``register`` and at the first step)."""
    opt = optimizer
    if opt is None or not hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    kinds = (LRScheduler, ReduceLROnPlateau)
    known: set[int] = set()
    todo = list(registered)
    while todo:
        obj = todo.pop()
        if id(obj) not in known:
            known.add(id(obj))
            todo += list(getattr(obj, "_schedulers", []) or [])
    found: list[Any] = []
    for ref in gc.get_referrers(opt):
        if isinstance(ref, kinds):
            found.append(ref)
        elif isinstance(ref, dict):  # (an instance's __dict__, on some Pythons)
            found += [o for o in gc.get_referrers(ref) if isinstance(o, kinds)]
    for sched in found:
        if id(sched) not in known and getattr(sched, "optimizer", None) is opt:
            raise TypeError(
                f"a {type(sched).__name__} steps a registered optimizer but is not "
                "registered: a member that heals or restores would train at another "
                "learning rate than its peers. Register it with the model and the "
                "optimizer: ft.register(model=..., optimizer=..., scheduler=sched), and "
                "step it under `if tx.committed:`"
            )
