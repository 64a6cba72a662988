"""The heal's wire format, checked on the way in, and the tensor helpers of the state
registry (:mod:`fastft.runtime.state.registry`): a header that is JSON (never a pickle: a peer's
header must not run code), byte buffers the tensors lie in."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import torch

_DEFERRED = "optimizer"
"""The section a heal may send last, while the step runs (:meth:`StateRegistry.pack`)."""
_ALIGN = 64
"""Byte alignment of each tensor in a packed heal buffer (any dtype can view it)."""
_DIRECT_BYTES = 1 << 20
"""Tensors this large are sent by a heal as they are, not copied into a buffer first."""


def _view(flat: torch.Tensor, off: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` at byte ``off`` of the byte buffer ``flat``."""
    n = math.prod(shape) * dtype.itemsize
    return flat[off : off + n].view(dtype).view(shape)


def _header(header: bytes) -> dict[str, Any]:
    """A heal's header, checked: JSON with the fields :meth:`StateRegistry.pack` writes
    (a peer's header is never unpickled: it could run code)."""
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"heal: the header is not JSON ({e})") from None
    if not isinstance(meta, dict) or set(meta) != {"sections", "entries", "buffers", "tail"}:
        raise ValueError("heal: the header does not have the fields of a heal's header")
    ok = (
        isinstance(meta["sections"], dict)
        and all(isinstance(v, str) for v in meta["sections"].values())
        and isinstance(meta["entries"], list)
        and all(isinstance(e, list) and len(e) == 6 for e in meta["entries"])
        and isinstance(meta["buffers"], list)
        and all(
            isinstance(b, list) and len(b) == 2 and b[0] in ("cpu", "cuda") and _nat(b[1])
            for b in meta["buffers"]
        )
        and _nat(meta["tail"])
    )
    if not ok:
        raise ValueError("heal: a malformed header")
    return meta


def _nat(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(wires: list[torch.Tensor], wire: Any, off: Any, dtype: Any, shape: Any) -> torch.Tensor:
    """The tensor a header entry places on the wires, checked against them."""
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"heal: {dtype!r} is not a torch dtype")
    if not (_nat(wire) and wire < len(wires) and _nat(off) and isinstance(shape, list)):
        raise ValueError("heal: a malformed header entry")
    if not all(_nat(n) for n in shape):
        raise ValueError("heal: a malformed tensor shape")
    if off + math.prod(shape) * dt.itemsize > wires[wire].numel():
        raise ValueError("heal: a header entry lies outside its wire")
    return _view(wires[wire], off, dt, tuple(shape))


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return obj


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` in one contiguous buffer (what DDP's buckets use)."""
    return torch._utils._flatten_dense_tensors(tensors)  # noqa: SLF001 - no public equivalent


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``like`` (the inverse of :func:`flatten`)."""
    return list(torch._utils._unflatten_dense_tensors(flat, like))  # noqa: SLF001 - (as above)
