"""What :meth:`~fastft.runtime.state.registry.StateRegistry.register` refuses, with the
reason and the fix: state a heal cannot send, a learning-rate scheduler that steps the
registered optimizer without being registered, and a data loader of the script's whose
order is state but that is not registered. Refused at ``register``, each would otherwise
surface after a fault: a heal that fails its retries, or a member that trains at another
learning rate, or on other batches, than its peers from its restart on."""

from __future__ import annotations

import gc
import inspect
from typing import Any

import torch

import fastft.runtime.state.tree as tree

__all__ = ["unregistered_loader", "unregistered_scheduler", "unsendable"]


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


def unregistered_loader(registered: list[Any]) -> None:
    """A TypeError if a torch ``DataLoader`` that shuffles or holds a generator of its own,
    a local or global of the script's code that calls ``ft.register``, is not registered
    (itself, or as a registered ``fastft.Batches``'s loader): its order and its place in
    the pass are state that a restarted or healed member loses, and nothing compares
    them (issue 61: such a loader left out, the run ended 6.7e-2 off the fault-free one,
    the replicas equal). Not looked for when a library calls ``register`` for the script
    (an integration's loop), nor in loaders that neither shuffle nor own a generator (an
    evaluation's: a restart reads them again from the start, as the fault-free run)."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__", "").startswith("fastft."):
        if not frame.f_globals["__name__"].startswith("fastft.runtime."):
            return  # (an integration registers: its loop draws the data)
        frame = frame.f_back
    if frame is None:
        return
    held = {id(o) for o in registered} | {id(getattr(o, "loader", None)) for o in registered}
    for scope in (frame.f_locals, frame.f_globals):
        for name, obj in list(scope.items()):
            if not isinstance(obj, DataLoader) or id(obj) in held:
                continue
            sampler = getattr(obj.batch_sampler, "sampler", obj.sampler)
            own = obj.generator is not None
            shuffles = isinstance(sampler, RandomSampler) or (
                isinstance(sampler, DistributedSampler) and sampler.shuffle
            )
            if own or shuffles:
                what = "has a generator of its own" if own else "shuffles"
                raise TypeError(
                    f"the script's DataLoader {name!r} {what} but is not registered: its "
                    "order and its place in the pass are state that a restarted or healed "
                    "member loses, and its batches would differ from its peers' with no "
                    "check to see it. Register it and draw each step's global batch from "
                    f"it: data = fastft.Batches({name}); ft.register(..., data=data); "
                    "x, y = data.next() (a loader for evaluation: shuffle=False, no "
                    "generator)"
                )
