"""One attempt of one step, as the user's ``with ft.transaction() as tx:`` sees it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fastft.interrupt import allreduce as interruptible_allreduce

if TYPE_CHECKING:
    from fastft.runtime.ports import RuntimePorts

__all__ = ["StepPorts", "Transaction"]


class StepPorts(Protocol):
    """A step attempt's entry and exit, as a transaction uses them
    (:class:`~fastft.runtime.attempt.StepAttempts` is one)."""

    def enter(self, tx: Transaction) -> Transaction: ...

    def exit(self, tx: Transaction, et: Any, ev: Any) -> bool:
        """Whether the exception (if any) was handled: the step rolled back."""


class Transaction:
    """One attempt of one step; use as a context manager from :meth:`fastft.Runtime.transaction`.

    ``step``: the step number; ``rank``/``world``: this worker's dense rank and the
    number of members in the current epoch (partition the step's global batch by them);
    ``committed`` is set when the ``with`` block ends.
    """

    def __init__(self, rt: RuntimePorts, attempts: StepPorts) -> None:
        self._rt = rt
        self._attempts = attempts
        self.step = -1
        self.epoch = -1
        self.rank = -1
        self.world = 0
        self.committed = False

    def __enter__(self) -> Transaction:
        return self._attempts.enter(self)

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        try:
            return self._attempts.exit(self, et, ev)
        finally:
            self._rt.heartbeat.between(True)  # the user's code until the next step

    def shard(self, n: int) -> slice:
        """This member's part of the step's global batch of ``n`` samples: contiguous and
        balanced (the first ``n % world`` members take one more), so whatever the epoch's
        size every sample of a committed step is consumed exactly once (S5 when the world
        shrinks). After it, :meth:`allreduce_gradients` weights each member's gradient by
        its share: the result is the gradient of the mean over the whole global batch.

        In an elastic world, the attempts of a step after it rolled back give each member
        a piece of the samples nobody kept: the members that had finished their part add
        the gradient they kept (``keep_gradients``, :mod:`fastft.runtime.state.kept`)."""
        rt = self._rt
        kept = rt.engine.kept
        part = kept.shard(rt.engine.view, self.step, n, self.world, self.rank)
        # A part that will be kept is worth finishing: a peer's fault from here on is
        # raised when the part is done (at the allreduce), not in the middle of it, and
        # the retry adds the part instead of computing a larger one from scratch; for at
        # most half the rollback timeout, which is how long the closer of the next epoch
        # waits for a survivor before it leaves it out.
        half = rt.config.rollback_timeout_s / 2
        rt.interrupter.defer(half if kept.worth_finishing() or rt.sharded else 0.0)
        if rt.sharded and n % self.world:
            raise ValueError(
                f"tx.shard({n}) over {self.world} members of shard groups: FSDP averages a "
                "group's gradients with equal weights, so the global batch must divide "
                "evenly; use a multiple of the world size"
            )
        return part

    def allreduce_gradients(self, model: nn.Module | None = None) -> None:
        """Average the gradients of the registered model over the epoch (interruptible);
        weighted by the members' shares when :meth:`shard` was used. With shard groups,
        each shard over the groups; with ``--sync every-k:N``, only at every N-th step
        (the others are each replica group's own), which also averages the parameters and
        the optimizer state (applied at its commit)."""
        self._rt.injector.fire_due(self.step, point="collective")
        self._rt.reduce_gradients(model)
        self._rt.injector.fire_due(self.step, point="reduced")

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` in place over the epoch's members (interruptible). Tensors of
        different shapes or types go as one flat buffer per type (a process group's
        allreduce of a list takes one size: Gloo failed "invalid tensor size" after its
        retries); every member must pass the same list."""
        rt = self._rt
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("tx.allreduce takes a list of tensors (each summed in place)")
        one_shape = len({(t.shape, t.dtype, t.device) for t in tensors}) <= 1
        with rt.heartbeat.blocked:
            if one_shape and all(t.is_contiguous() for t in tensors):
                interruptible_allreduce(rt.require_pg(), tensors, rt.interrupter)
                return
            groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for t in tensors:
                groups.setdefault((t.dtype, t.device), []).append(t)
            flats = [torch.cat([t.reshape(-1) for t in g]) for g in groups.values()]
            for flat in flats:  # (one call per type: a list takes one size)
                interruptible_allreduce(rt.require_pg(), [flat], rt.interrupter)
            for g, flat in zip(groups.values(), flats, strict=True):
                for t, part in zip(g, flat.split([t.numel() for t in g]), strict=True):
                    t.copy_(part.view_as(t))

    def send(self, tensor: torch.Tensor) -> None:
        """Pipeline stages (``--stage``): this member's output of this step, for the
        member of the same rank in the next stage (:mod:`fastft.runtime.groups.flow`)."""
        rt = self._rt
        if rt.flow is None:
            raise RuntimeError("tx.send(): this job is no pipeline stage (fastft run --stage)")
        rt.flow.send(self.step, rt.rank, tensor)

    def recv(self) -> torch.Tensor:
        """Pipeline stages: the previous stage's output of this step for this member, once
        that stage has committed the step (interruptible)."""
        rt = self._rt
        if rt.flow is None:
            raise RuntimeError("tx.recv(): this job is no pipeline stage (fastft run --stage)")
        with rt.heartbeat.blocked:
            return rt.flow.recv(self.step, rt.rank, rt.interrupter.check)
