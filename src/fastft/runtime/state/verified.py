"""The last verified state: what a replica mismatch's repair goes back to (issue 61).

The in-band check (:mod:`fastft.runtime.state.compare`) compares the state each checked
step began with. A member that held corrupted state since then (a flipped bit, a change
of the script's on one rank) fed its gradients into every member's updates of the steps
between the two checks, so healing it from the majority leaves every replica off the
fault-free run. Instead, each member keeps a copy of the state of the last step whose
check passed, equal on every member; on a mismatch every member goes back to it (an
epoch that restores it, :attr:`~fastft.runtime.contract.EpochView.rewind`) and runs
the steps since again: their batches (registered loaders are part of the state) and
their randomness (:func:`~fastft.runtime.state.rng.reseed`) are functions of the step,
so the repaired run is the fault-free one bit for bit.

Cost: the copy of a checked step is taken as it begins (one copy of the registered
state, parameters and optimizer state included, into the buffers of the copy it
replaces), kept aside until the step's check passes; memory: two copies of the state at
most (the verified one and the one being checked), in host memory for a GPU's tensors.
``bench/replica_check.py`` measures both."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Protocol

import torch

import fastft.runtime.state.tree as tree
from fastft.runtime.state.wire import clone

__all__ = ["Verified", "refill"]

CPU = torch.device("cpu")
"""Where the copies of a GPU's state are kept: in host memory, not beside the state."""


class StateRegistry(Protocol):
    """What of :class:`~fastft.runtime.state.registry.StateRegistry` a copy uses."""

    def state(self, step: int) -> dict[str, Any]: ...

    def load_state(self, st: dict[str, Any]) -> int: ...


class Verified:
    """One member's copy of the last verified state, and the one a check is comparing."""

    def __init__(self) -> None:
        self.step: int | None = None
        """The step whose check passed with the state held (None: none yet)."""
        self._state: dict[str, Any] | None = None
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._spare: Any = None
        """The copy verified before the current one: the next hold's buffers."""
        self.wanted: int | None = None
        """Set by a mismatch's repair: the step this member goes back to; its arrival at
        the next epoch offers it (:class:`~fastft.runtime.engine.formation.Arrival`)."""

    def hold(self, registry: StateRegistry, step: int) -> None:
        """As a checked step begins: a copy of the state it begins with (into the tensors
        of the copy it no longer needs, where they fit: no allocation in a steady run)."""
        spare = self._pending[1] if self._pending is not None else self._spare
        self._spare = None
        self._pending = (step, refill(spare, registry.state(step)))

    def passed(self, step: int) -> None:
        """The check of ``step`` passed on every member: its copy is the verified state."""
        if self._pending is not None and self._pending[0] == step:
            self._spare = self._state
            self.step, self._state = step, self._pending[1]
        self._pending = None

    def want(self, step: int | None) -> None:
        self.wanted = step

    def restore(self, registry: StateRegistry, step: int) -> int:
        """Load the verified state of ``step`` into ``registry``; returns its step.
        Raises LookupError if this member does not hold that step's."""
        if self._state is None or self.step != step:
            raise LookupError(
                f"this member holds the verified state of step {self.step}, not of step {step}"
            )
        self.wanted = None
        return registry.load_state(clone(self._state))

    def forget(self) -> None:
        """The state was replaced from elsewhere (a durable checkpoint, a fresh start):
        the copy is of another run's past."""
        self.step, self._state, self._pending, self.wanted = None, None, None, None
        self._spare = None


def refill(old: Any, new: Any) -> Any:
    """A copy of ``new`` (a ``state_dict()`` tree) that nothing can change later, with its
    tensors copied into those of ``old`` where the shapes match (:func:`clone` else)."""
    if isinstance(new, torch.Tensor):
        src = new.detach()
        home = CPU if src.is_cuda else src.device  # (a GPU's memory is the model's own)
        same = isinstance(old, torch.Tensor) and (old.shape, old.dtype, old.device) == (
            src.shape,
            src.dtype,
            home,
        )
        return old.copy_(src) if same else src.to(home, copy=True)
    if isinstance(new, dict):  # (recursing without an old one too: a GPU's go to the host)
        olds = old if isinstance(old, dict) else {}
        out = {k: refill(olds.get(k), v) for k, v in new.items()}
        if isinstance(new, OrderedDict):
            meta = copy.deepcopy(getattr(new, "_metadata", None))
            return tree.with_metadata(OrderedDict(out), meta)
        return out
    if isinstance(new, list | tuple):
        fits = isinstance(old, list | tuple) and len(old) == len(new)
        items = [refill(old[i] if fits else None, v) for i, v in enumerate(new)]
        return items if isinstance(new, list) else tuple(items)
    return clone(new)
