"""What a step may change and a heal must transfer: the state registry.

Registered objects follow the ``state_dict()/load_state_dict()`` protocol (``nn.Module``,
``torch.optim.Optimizer``, stateful samplers and data loaders, or anything of the user's).
The model and the optimizer change only when a step commits, so a rollback only drops
gradients; module buffers (BatchNorm running stats) and other registered objects change
during the forward pass or when data is drawn, so they are snapshotted when a step begins
and restored when it rolls back. A heal sends everything, plus the committed step.

RNG: the runtime reseeds Python, NumPy and torch from (seed, step, rank) at the start of
every step attempt (:func:`fastft.runtime.state.rng.reseed`): RNG state is a function of
the step and needs no transfer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fastft.runtime.groups.hsdp import is_sharded, load_model_shards, local, optimizer_shards
from fastft.runtime.state import digests
from fastft.runtime.state.attributes import ModuleAttributes, module_attributes
from fastft.runtime.state.bucket import GradBucket
from fastft.runtime.state.optimizers import Optimizers
from fastft.runtime.state.refusals import (
    unregistered_loader,
    unregistered_scheduler,
    unsendable,
)
from fastft.runtime.state.verified import Verified
from fastft.runtime.state.wire import (
    _tensors,
    clone,
    pack_state,
    unpack_state,
    wire_allocate,
    wire_tail,
)

if TYPE_CHECKING:
    from fastft.runtime.state.outer import Outer

__all__ = ["MODEL_ATTRIBUTES", "ByReference", "Stateful", "StateRegistry"]

MODEL_ATTRIBUTES = "model_attributes"  # (the model's plain attributes: :mod:`.attributes`)


def _version(t: torch.Tensor) -> int:
    """Autograd's count of ``t``'s in-place changes (no public reader)."""
    return int(t._version)  # noqa: SLF001 - autograd's in-place version counter


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class ByReference(Stateful, Protocol):
    """State a step replaces rather than changes (JAX's pytrees, :mod:`fastft.jax`): the
    committed values are kept by reference, a step proposes new ones, a commit adopts
    them and a rollback drops them (nothing to snapshot or undo). ``state_dict()`` gives
    the committed values as tensors (a heal's, a checkpoint's, the digest's)."""

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def lose(self) -> None:
        """Fill the committed values with NaN (the injected ``state_lost`` fault)."""

    @property
    def pending(self) -> bool:
        """Whether the values are not made yet (a build that a heal may replace: reading
        ``state_dict()`` makes them)."""


class StateRegistry:
    """The objects a worker registered, by name."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._others: dict[str, Stateful] = {}
        self._step_snapshot: dict[str, Any] | None = None
        self.bucket = GradBucket()
        """The gradients' flat bucket (:meth:`grad_bucket`)."""
        self._sharded: bool | None = None
        self._average: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """A sync step's averaged parameters and optimizer state, applied at its commit."""
        self.outer: Outer | None = None
        """``--sync diloco``: the anchor and the outer optimizer (:mod:`fastft.runtime.sync`)."""
        self.by_reference: ByReference | None = None
        """State kept by reference (:class:`ByReference`: ``fastft.jax``'s pytrees)."""
        self._versions: list[int] = []
        """The parameters' version counters as the step began."""
        self.resume: int | None = None
        """``ft.register(step=...)``: the step of the state the script loaded itself."""
        self.verified = Verified()
        """The state of the last step whose replica check passed (a mismatch's repair)."""

    def register(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        **others: Stateful,
    ) -> None:
        if model is not None:
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
            self.model = model
            self._sharded = None
        if isinstance(optimizer, list | tuple):  # (several: a GAN's, :mod:`.optimizers`)
            optimizer = Optimizers(*optimizer)
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
                )
            unsendable("optimizer", optimizer)  # (its settings: a custom one's own values)
            self.optimizer = optimizer
        for name, obj in others.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict(); "
                    "wrap it or register what it depends on"
                )
            unsendable(name, obj)  # refused now, not after a fault's retries
            self._others[name] = obj
        found = module_attributes(model) if model is not None else {}  # (its own values)
        if found and MODEL_ATTRIBUTES not in self._others:
            self._others[MODEL_ATTRIBUTES] = ModuleAttributes(found)
        self.check_schedulers()
        unregistered_loader([*self._others.values()])

    def check_schedulers(self) -> None:
        """Refuse a scheduler of a registered optimizer (the main one, or one registered
        by name) that is not registered
        (:func:`fastft.runtime.state.refusals.unregistered_scheduler`)."""
        others = list(self._others.values())
        opts = [self.optimizer, *(o for o in others if isinstance(o, torch.optim.Optimizer))]
        for opt in [*opts, *getattr(self.optimizer, "optimizers", [])]:
            unregistered_scheduler(opt, others)  # (each optimizer's: a GAN's second too)

    # --- per step --------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether the registered model is sharded (FSDP2's DTensors)."""
        if self._sharded is None:
            self._sharded = is_sharded(self.model)
        return self._sharded

    def local_parameters(self) -> list[torch.Tensor]:
        """The model's parameters as this member holds them (its shards with FSDP2), as
        tensors that share the parameters' storage."""
        if self.model is None:
            raise RuntimeError("register(model=...) first")
        return [local(p).detach() for p in self.model.parameters()]

    def float_buffers(self) -> list[torch.Tensor]:
        """The model's floating-point buffers (BatchNorm's running statistics; not its
        counters), which ``--buffers average`` averages with each step's gradients."""
        if self.model is None:
            return []
        return [b for b in self.model.buffers() if b.is_floating_point()]

    def begin_step(self) -> None:
        """Snapshot what a rolled-back step must undo: buffers, the optimizer's settings
        (``param_groups``: a learning rate set by hand in the step) and other objects;
        and note the parameters' versions (:meth:`changed_parameters`)."""
        snap: dict[str, Any] = {}
        if self.model is not None:
            snap["buffers"] = [b.detach().clone() for b in self.model.buffers()]
            if not self.sharded:
                self._versions = [_version(p) for p in self.model.parameters()]
        if self.optimizer is not None:
            snap["param_groups"] = [
                {k: clone(v) for k, v in g.items() if k != "params"}
                for g in self.optimizer.param_groups
            ]
        for name, obj in self._others.items():
            snap[name] = clone(obj.state_dict())
        self._step_snapshot = snap

    def changed_parameters(self) -> str | None:
        """The name of a parameter changed in place since the step began (its version
        counter moved), or None. A step body changes gradients, never parameters: the
        update is the commit's, and a rollback could not undo a change of its own."""
        if self.model is None or self.sharded or not self._versions:
            return None
        for (name, p), v in zip(self.model.named_parameters(), self._versions, strict=False):
            if _version(p) != v:
                return name
        return None

    @property
    def others(self) -> Mapping[str, Stateful]:
        """The registered objects but the model and the optimizer, by name (read-only)."""
        return MappingProxyType(self._others)

    @property
    def snapshot(self) -> Mapping[str, Any]:
        """What the current step began with (:meth:`begin_step`; empty after a commit)."""
        return MappingProxyType(self._step_snapshot or {})

    def committed(self) -> None:
        """The step's update is applied: what it began with is no longer what a rollback
        restores. (Kept, a fault between this commit and the next step's start rolled the
        buffers and the other objects back to before the committed step: a data position
        one batch behind the peers, a loss hidden by the allreduce of gradients.)"""
        self._step_snapshot = None
        self.verified.want(None)  # (a repair that did not go back: a step went on)
        if self.outer is not None:
            self.outer.committed()
        if self.by_reference is not None:
            self.by_reference.commit()

    def rollback(self) -> None:
        """Drop the step's gradients and restore what the step changed. The gradient
        bucket is replaced, not zeroed: an allreduce abandoned on a dead peer may still
        write into the old one. The new one is built here, while the epoch re-forms, so
        that the retry's backward accumulates into it as any step's does; built by the
        retry instead, it cost a fresh gradient per parameter and a copy of each (10-30
        ms at 4.2M parameters with 3 workers on 2 cores)."""
        self._average = None  # (a sync step that did not commit)
        if self.outer is not None:
            self.outer.rollback()  # (an outer step whose step did not commit)
        if self.by_reference is not None:
            self.by_reference.rollback()  # (the step's proposal is dropped)
        old = self.bucket.drop()
        if old is not None and self.model is not None:
            for p in self.model.parameters():
                p.grad = None  # views of the old bucket: nothing in them is worth copying
            self.grad_bucket()
        else:
            self.zero_grads()
        snap = self._step_snapshot
        if snap is None:
            return
        if self.optimizer is not None and "param_groups" in snap:
            for g, saved in zip(self.optimizer.param_groups, snap["param_groups"], strict=False):
                for k in [k for k in g if k != "params" and k not in saved]:
                    del g[k]
                g.update(clone(saved))
        if self.model is not None and "buffers" in snap:
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), snap["buffers"], strict=True):
                    b.copy_(saved)
        for name, obj in self._others.items():
            if name in snap:
                obj.load_state_dict(clone(snap[name]))

    def sync_tensors(self) -> list[torch.Tensor]:
        """What ``every-k`` averages over the replica groups at a sync step: this member's
        parameters (its shards) and its optimizer state's tensors, in a fixed order."""
        out: list[torch.Tensor] = []
        if self.model is not None:
            out += self.local_parameters()
        if self.optimizer is not None:
            state = local(self.optimizer.state_dict()["state"])
            out += [t for t in _tensors(state) if t.dim() > 0 and t.is_floating_point()]
        return out

    def hold_average(self, targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep a sync step's averages until its commit (:meth:`apply_average`)."""
        self._average = list(zip(targets, values, strict=True))

    def apply_average(self) -> None:
        """At a sync step's commit, before the optimizer's update: every replica group
        then starts it from the same parameters and optimizer state."""
        held, self._average = self._average, None
        if held:
            with torch.no_grad():
                for target, value in held:
                    target.copy_(value)

    def grad_bucket(
        self, carry: list[torch.Tensor] | None = None, slots: int | None = None
    ) -> torch.Tensor | None:
        """One flat tensor that every trainable parameter's ``.grad`` is a view of (as
        DDP's ``gradient_as_bucket_view``): backward accumulates straight into it and the
        allreduce runs on it in place, without a flatten and an unflatten copy per step.
        Built on first use (copying any gradients that exist), rebuilt if something
        replaced a ``.grad``; None if the parameters do not share a dtype and device.
        ``carry``: tensors of the same dtype that ride the same allreduce, in a tail of
        their total size plus one (:attr:`bucket_tail`; ``--buffers average``); ``slots``:
        the in-band vote's elements after it (:attr:`bucket`'s ``slots``)."""
        if self.model is None:
            raise RuntimeError("register(model=...) before reducing gradients")
        if self.sharded:
            return None  # (FSDP2 sets its own sharded gradients)
        params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        return self.bucket.of(params, carry, slots)

    @property
    def bucket_tail(self) -> torch.Tensor | None:
        """The gradient bucket's tail (:meth:`grad_bucket`'s ``carry``), None without one."""
        return self.bucket.tail

    def zero_grads(self) -> None:
        """Zero the gradients, in place in the bucket when there is one (keeping the
        views), else by dropping them."""
        if self.bucket.flat is not None:
            self.bucket.flat.zero_()
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def gradients(self) -> list[torch.Tensor]:
        """The gradients to reduce, in parameter order (parameters without one get zeros,
        so every member reduces the same layout)."""
        if self.model is None:
            raise RuntimeError("register(model=...) before reducing gradients")
        out = []
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(local(p.grad))  # (with FSDP2: this member's shard of it)
        return out

    # --- healing ---------------------------------------------------------------------------
    def state(self, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {"step": step}
        if self.model is not None:
            out["model"] = local(self.model.state_dict())
        if self.optimizer is not None:
            out["optimizer"] = local(self.optimizer.state_dict())
        out["others"] = {name: obj.state_dict() for name, obj in self._others.items()}
        if self.outer is not None:
            out["outer"] = self.outer.state_dict()
        if self.by_reference is not None:
            out["by_reference"] = self.by_reference.state_dict()
        return out

    def load_state(self, st: dict[str, Any]) -> int:
        """Load a whole state as :meth:`state` gives it; returns its step."""
        return self._apply(st)

    def pack(self, step: int, *, defer: bool = False) -> tuple[bytes, list[torch.Tensor]]:
        """The state of ``step`` for a heal: a small JSON header and flat byte tensors
        (:func:`fastft.runtime.state.wire.pack_state`; ``defer``: the optimizer's large
        tensors last, from wire :meth:`tail` on)."""
        return pack_state(self.state(step), defer=defer)

    tail = staticmethod(wire_tail)
    allocate = staticmethod(wire_allocate)

    def load_packed(self, header: bytes, wires: list[torch.Tensor], part: str = "all") -> int:
        """Load a state received as :meth:`pack` sent it; returns its step. ``part``:
        ``"head"`` loads all but the optimizer state (whose wires may be in transit),
        ``"tail"`` the optimizer state alone."""
        return self._apply(unpack_state(header, wires, part))

    def _apply(self, st: dict[str, Any]) -> int:
        if self.model is not None and "model" in st:
            if self.sharded:
                load_model_shards(self.model, st["model"])
            else:
                self.model.load_state_dict(st["model"])
        if self.optimizer is not None and "optimizer" in st:
            opt = st["optimizer"]
            self.optimizer.load_state_dict(
                optimizer_shards(self.optimizer, opt) if self.sharded else opt
            )
        for name, obj in self._others.items():
            if name in st.get("others", {}):
                # A copy that owns its memory: a heal's tensors are views of its receive
                # buffers, and an object may keep what it is given (a data loader keeps its
                # sampler's generator state; a view there crashed torch's set_state).
                obj.load_state_dict(clone(st["others"][name]))
        if self.outer is not None and "outer" in st:
            self.outer.load_state_dict(st["outer"])
        if self.by_reference is not None and "by_reference" in st:
            self.by_reference.load_state_dict(st["by_reference"])
        if "model" in st or "others" in st:
            # what a step began with is gone; a deferred optimizer state is loaded inside
            # a step, whose snapshot stays
            self._step_snapshot = None
        return int(st["step"])

    def digest(self, step: int) -> str:
        """Hash of the replicated state (parameters, optimizer state, step): equal on
        every member after every commit (S3)."""
        return digests.state_digest(step, self.model, self.optimizer, self.outer, self.by_reference)

    def outer_digest(self) -> str | None:
        """``diloco``: hash of the outer state, equal on every member of a shard index after
        every commit (the parameters are each group's own between outer steps)."""
        return None if self.outer is None else digests.outer_digest(self.outer)
