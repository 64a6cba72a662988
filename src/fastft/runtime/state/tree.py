"""A state's structure as JSON, with its tensors apart: what a heal sends and a checkpoint
keeps, in a form that cannot run code when it is read (unlike a pickle, whose reader
calls whatever the bytes name).

:func:`dump` walks a ``state_dict()`` result, appends every tensor it meets to a list and
writes a reference in its place; :func:`load` rebuilds the structure around the tensors it
is given. Every container is a one-key JSON object naming its type, so nothing is guessed
on the way back:

========================  ==================================================
``{"T": i}``              the ``i``-th tensor
``{"l": [...]}``          list;  ``{"t": [...]}`` tuple
``{"d": [[k, v], ...]}``  dict (any keys this table allows, in order)
``{"o": [...], "m": x}``  OrderedDict, with a module state_dict's ``_metadata``
``{"b": "base64"}``       bytes
``{"dtype": "float32"}``  ``torch.dtype``;  ``{"size": [...]}`` ``torch.Size``;
                          ``{"device": "cuda:0"}`` ``torch.device``
``{"np": [dtype, shape, "base64"]}``  a NumPy array (NumPy scalars become numbers)
========================  ==================================================

Numbers, strings, booleans and None are themselves. Anything else is a TypeError at
:func:`dump` that names where it is: return plain values from ``state_dict()``.
"""

from __future__ import annotations

import base64
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["dump", "load"]

_MAX_DEPTH = 64


def with_metadata(out: OrderedDict[Any, Any], meta: Any) -> OrderedDict[Any, Any]:
    """``out`` with torch's ``state_dict`` metadata ``meta`` (None: none), where torch keeps
    it (a module's ``load_state_dict`` reads it: versions of its submodules' layouts)."""
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]  # noqa: SLF001 - torch's own attribute
    return out


def dump(obj: Any, tensors: list[torch.Tensor], where: str = "state") -> bytes:
    """``obj`` as JSON bytes; its tensors appended to ``tensors`` and referenced."""
    return json.dumps(_enc(obj, tensors, where, 0), separators=(",", ":")).encode()


def load(data: bytes, tensors: Mapping[int, torch.Tensor]) -> Any:
    """The structure :func:`dump` wrote, around ``tensors``; ValueError for anything that is
    not such a structure (it never runs code, whatever ``data`` holds)."""
    try:
        node = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"state structure is not JSON: {e}") from None
    return _dec(node, tensors, 0)


def _enc(obj: Any, tensors: list[torch.Tensor], where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise TypeError(f"{where}: nested more than {_MAX_DEPTH} levels")
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"T": len(tensors) - 1}
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, list | tuple):
        items = [_enc(v, tensors, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
        return {"t" if isinstance(obj, tuple) else "l": items}
    if isinstance(obj, dict):
        items = [
            [
                _enc(k, tensors, f"{where} key", depth + 1),
                _enc(v, tensors, f"{where}.{k}", depth + 1),
            ]
            for k, v in obj.items()
        ]
        if isinstance(obj, OrderedDict):
            meta = getattr(obj, "_metadata", None)
            return {"o": items, "m": _enc(meta, tensors, f"{where}._metadata", depth + 1)}
        return {"d": items}
    if isinstance(obj, bytes | bytearray):
        return {"b": base64.b64encode(bytes(obj)).decode()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None  # type: ignore[assignment]
    if np is not None and isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {"np": [a.dtype.str, list(a.shape), base64.b64encode(a.tobytes()).decode()]}
    if np is not None and isinstance(obj, np.generic):
        return _enc(obj.item(), tensors, where, depth)
    raise TypeError(
        f"{where} is a {type(obj).__qualname__}: a heal and a checkpoint send tensors and "
        "JSON values (dict, list, tuple, str, int, float, bool, None, bytes, NumPy arrays); "
        "return those from state_dict()"
    )


def _dec(node: Any, tensors: Mapping[int, torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"state structure nested more than {_MAX_DEPTH} levels")
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict) or not 1 <= len(node) <= 2:
        raise ValueError(f"state structure: unexpected {type(node).__name__} node")
    tag = next(iter(node))
    v = node[tag]
    d = depth + 1
    if tag == "T" and len(node) == 1:
        if isinstance(v, bool) or not isinstance(v, int) or v not in tensors:
            raise ValueError(f"state structure: no tensor {v!r}")
        return tensors[v]
    if tag in ("l", "t") and len(node) == 1 and isinstance(v, list):
        items = [_dec(x, tensors, d) for x in v]
        return tuple(items) if tag == "t" else items
    if tag in ("d", "o") and isinstance(v, list):
        pairs = []
        for kv in v:
            if not isinstance(kv, list) or len(kv) != 2:
                raise ValueError("state structure: a dict item is not a [key, value] pair")
            k = _dec(kv[0], tensors, d)
            try:
                hash(k)
            except TypeError:
                raise ValueError("state structure: an unhashable dict key") from None
            pairs.append((k, _dec(kv[1], tensors, d)))
        if tag == "d" and len(node) == 1:
            return dict(pairs)
        if tag == "o" and set(node) == {"o", "m"}:
            out: OrderedDict[Any, Any] = OrderedDict(pairs)
            meta = _dec(node["m"], tensors, d)
            return with_metadata(out, meta)
    if len(node) == 1 and isinstance(v, str):
        if tag == "b":
            return _b64(v)
        if tag == "dtype":
            dt = getattr(torch, v, None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"state structure: {v!r} is not a torch dtype")
            return dt
        if tag == "device":
            try:
                return torch.device(v)
            except (RuntimeError, ValueError):
                raise ValueError(f"state structure: {v!r} is not a device") from None
    if tag == "size" and len(node) == 1 and isinstance(v, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise ValueError("state structure: a size of non-integers")
        return torch.Size(v)
    if tag == "np" and len(node) == 1 and isinstance(v, list) and len(v) == 3:
        import numpy as np

        dtype, shape, data = v
        try:
            dt = np.dtype(dtype)
            if dt.hasobject or not isinstance(shape, list) or not isinstance(data, str):
                raise ValueError
            return np.frombuffer(_b64(data), dtype=dt).reshape(shape).copy()
        except (TypeError, ValueError):
            raise ValueError("state structure: a malformed NumPy array") from None
    raise ValueError(f"state structure: unknown node {tag!r}")


def _b64(s: str) -> bytes:
    try:
        return base64.b64decode(s.encode(), validate=True)
    except ValueError:
        raise ValueError("state structure: malformed base64") from None
