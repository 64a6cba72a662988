"""The heal's wire format, checked on the way in, and the tensor helpers of the state
registry (:mod:`fastft.runtime.state.registry`): a header that is JSON (never a pickle: a peer's
header must not run code), byte buffers the tensors lie in."""

from __future__ import annotations

import copy
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

import fastft.runtime.state.tree as tree

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


def clone(obj: Any) -> Any:
    """A copy of a ``state_dict()`` result that nothing the object does later can change:
    its tensors, NumPy arrays and containers copied (a rollback restores it as it was)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, OrderedDict):
        out: OrderedDict[Any, Any] = OrderedDict((k, clone(v)) for k, v in obj.items())
        return tree.with_metadata(out, copy.deepcopy(getattr(obj, "_metadata", None)))
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone(v) for v in obj)
    if isinstance(obj, set | bytearray):
        return copy.copy(obj)
    if type(obj).__module__ == "numpy" and hasattr(obj, "copy"):
        return obj.copy()  # (an ndarray: a script's own state mutated in place)
    return obj


_FLATTEN = torch._utils._flatten_dense_tensors, torch._utils._unflatten_dense_tensors  # noqa: SLF001
"""torch's own (DDP's buckets), in C++: no public equivalent, and on the step's path a
Python loop over the parameters would cost per parameter."""


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` in one contiguous buffer (what DDP's buckets use)."""
    return _FLATTEN[0](tensors)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``like`` (the inverse of :func:`flatten`)."""
    return list(_FLATTEN[1](flat, like))


def pack_state(st: dict[str, Any], *, defer: bool = False) -> tuple[bytes, list[torch.Tensor]]:
    """The state for a heal as a small header and a list of flat byte tensors ("wires")
    that the collectives send as they are: no serialization of tensor data. A tensor
    of at least ``_DIRECT_BYTES`` (contiguous, not 0-dim) is sent as a byte view of its
    own storage, without a copy, so the sender holds no second copy of a large state;
    the smaller ones are copied into one buffer per device (aligned for their dtype),
    so a state of many small tensors still costs one collective. The header is JSON:
    the state's structure with every tensor replaced by a reference
    (:mod:`fastft.runtime.state.tree`; nothing in it can run code where it is read), and
    where each tensor lies on the wires, which the receivers allocate from (:func:`wire_allocate`).

    ``defer``: the optimizer's large tensors go last, from wire :func:`wire_tail` on, so
    that a heal can load the rest first (``part="head"``) and let them follow while
    the step runs (``part="tail"``): a step needs the optimizer state only when it
    commits. Its small tensors stay in the buffers in front."""
    sections: dict[str, str] = {}
    entries: list[tuple[str, int, str, tuple[int, ...], int, int]] = []
    small: dict[str, list[tuple[torch.Tensor, int, int]]] = {}  # dev -> (t, entry, off)
    sizes: dict[str, int] = {}
    direct: list[tuple[torch.Tensor, int]] = []  # (byte view, entry)
    for name, obj in st.items():
        tensors: list[torch.Tensor] = []
        sections[name] = tree.dump(obj, tensors, name).decode()
        for i, t in enumerate(tensors):
            dtype = str(t.dtype).removeprefix("torch.")
            entries.append((name, i, dtype, tuple(t.shape), -1, 0))
            nbytes = t.numel() * t.element_size()
            if nbytes >= _DIRECT_BYTES and t.dim() > 0 and t.is_contiguous():
                direct.append((t.detach().view(torch.uint8).view(-1), len(entries) - 1))
                continue
            dev = t.device.type
            off = -(-sizes.get(dev, 0) // _ALIGN) * _ALIGN
            sizes[dev] = off + nbytes
            small.setdefault(dev, []).append((t, len(entries) - 1, off))
    wires: list[torch.Tensor] = []
    buffers: list[tuple[str, int]] = []
    for dev in sorted(sizes):
        flat = torch.empty(sizes[dev], dtype=torch.uint8, device=small[dev][0][0].device)
        for t, e, off in small[dev]:
            _view(flat, off, t.dtype, t.shape).copy_(t.detach())
            entries[e] = (*entries[e][:4], len(wires), off)
        wires.append(flat)
        buffers.append((dev, sizes[dev]))
    later = {_DEFERRED} if defer else set()
    tail = len(wires) + sum(entries[e][0] not in later for _, e in direct)
    direct.sort(key=lambda d: entries[d[1]][0] in later)  # stable: the deferred last
    for view, e in direct:
        entries[e] = (*entries[e][:4], len(wires), 0)
        wires.append(view)
        buffers.append((view.device.type, view.numel()))
    meta = {"sections": sections, "entries": entries, "buffers": buffers, "tail": tail}
    return json.dumps(meta, separators=(",", ":")).encode(), wires


def wire_tail(header: bytes) -> int:
    """The first wire that only the deferred optimizer state uses (:func:`pack_state`); the
    number of wires when nothing was deferred."""
    meta = _header(header)
    return int(meta["tail"])


def wire_allocate(header: bytes, cuda: torch.device | None = None) -> list[torch.Tensor]:
    """Empty flat byte tensors to receive the wires :meth:`pack` sent with ``header``;
    the sender's GPU tensors land on ``cuda`` (default: the current device)."""
    out = []
    for dev, size in _header(header)["buffers"]:
        device = (
            (cuda or torch.device("cuda", torch.cuda.current_device())) if dev == "cuda" else dev
        )
        out.append(torch.empty(size, dtype=torch.uint8, device=device))
    return out


def unpack_state(header: bytes, wires: list[torch.Tensor], part: str = "all") -> dict[str, Any]:
    """The state :func:`pack_state` packed, from its header and received wires. ``part``:
    ``"head"`` loads all but the optimizer state (whose wires may be in transit),
    ``"tail"`` the optimizer state alone."""
    if part not in ("all", "head", "tail"):
        raise ValueError(f"part must be 'all', 'head' or 'tail', not {part!r}")
    meta = _header(header)
    if len(wires) != len(meta["buffers"]):
        raise ValueError(f"heal: {len(wires)} wires for {len(meta['buffers'])} buffers")
    tensors: dict[str, dict[int, torch.Tensor]] = {}
    for name, i, dtype, shape, wire, off in meta["entries"]:
        tensors.setdefault(name, {})[i] = _entry(wires, wire, off, dtype, shape)
    st = {
        name: tree.load(blob.encode(), tensors.get(name, {}))
        for name, blob in meta["sections"].items()
        if part == "all" or name == "step" or (name == _DEFERRED) == (part == "tail")
    }
    return st
