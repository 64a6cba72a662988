"""The hashes of the replicated state that every member compares (S3): what a commit agrees
on (:func:`state_digest`) and, with ``--sync diloco``, the outer state (:func:`outer_digest`)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastft.runtime.groups.hsdp import local
from fastft.runtime.state.wire import _bytes, _tensors

if TYPE_CHECKING:
    from fastft.runtime.state.outer import Outer

__all__ = ["outer_digest", "state_digest"]


def state_digest(
    step: int,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    outer: Outer | None,
    by_reference: Any,
) -> str:
    """Hash of the parameters, the optimizer state, the outer state, the state kept by
    reference (a ``state_dict()`` of tensors) and ``step`` (16 hex digits)."""
    h = hashlib.sha256(str(step).encode())
    if model is not None:
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(_bytes(local(p)))  # (with FSDP2: this member's shard)
    if optimizer is not None:
        for t in _tensors(local(optimizer.state_dict()["state"])):
            h.update(_bytes(t))
    if outer is not None:
        for t in outer.tensors():
            h.update(_bytes(t))
    if by_reference is not None:
        for t in _tensors(by_reference.state_dict()):
            h.update(_bytes(t))
    return h.hexdigest()[:16]


def outer_digest(outer: Outer) -> str:
    """Hash of the outer state alone (16 hex digits)."""
    h = hashlib.sha256()
    for t in outer.tensors():
        h.update(_bytes(t))
    return h.hexdigest()[:16]
