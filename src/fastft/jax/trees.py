"""JAX pytrees as the tensors fastft moves, and back (no pickle, no host copy on a GPU).

- A committed leaf leaves as a torch tensor over the same buffer (DLPack: zero-copy on
  the CPU and on a GPU), for a heal, a checkpoint or the digest; it comes back as a new
  JAX array on the device of the leaf it replaces, into the receiver's own tree
  structure, checked leaf by leaf against it.
- A gradient is reduced in one flat buffer: the leaves are concatenated by one jitted
  function (float32 at least: Gloo sums no bfloat16), the buffer is handed to torch
  without a copy, the collective sums it in place, and one jitted function splits it back
  into the leaves' shapes and dtypes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

__all__ = [
    "Layout",
    "as_tensor",
    "from_tensor",
    "from_tensors",
    "layout_of",
    "padded",
    "split",
    "to_flat",
]

Layout = tuple[tuple[tuple[int, ...], str], ...]
"""Each leaf's (shape, dtype name), in tree order."""


def layout_of(leaves: list[Any]) -> Layout:
    return tuple((tuple(int(n) for n in leaf.shape), str(leaf.dtype)) for leaf in leaves)


def as_tensor(leaf: jax.Array) -> torch.Tensor:
    """The leaf as a torch tensor over its own buffer (read it, never write it: JAX
    arrays are immutable, and the committed state is kept by reference)."""
    leaf.block_until_ready()
    return torch.from_dlpack(leaf)


def from_tensor(t: torch.Tensor, like: Any) -> jax.Array:
    """A new JAX array with ``t``'s values, placed as ``like`` is: :func:`from_tensors`
    of one."""
    return from_tensors([t], [like])[0]


def from_tensors(tensors: list[torch.Tensor], likes: list[Any]) -> list[jax.Array]:
    """New JAX arrays with the tensors' values, each placed as its ``like`` is. Copies:
    ``t`` may be a buffer its caller reuses (a heal's receive buffer, the verified copy),
    and ``device_put`` of a numpy array on the CPU aliases its memory (``may_alias=False``
    did not stop it in jax 0.10.2). An array JAX placed by default (uncommitted, as a
    script's own arrays are) comes back uncommitted: a committed one is another signature
    to every jitted function, which would trace and compile again at the first step after
    a heal. The CPU tensors are numpy copies (one memcpy: 5x faster than a copy through
    DLPack here) placed by one ``device_put`` (a heal of the 4.2M transformer has 135
    leaves: ~30 % less than one call per leaf, ad hoc)."""
    out: list[Any] = [None] * len(tensors)
    batches: dict[bool, tuple[list[int], list[np.ndarray], list[Any]]] = {}
    for i, (t, like) in enumerate(zip(tensors, likes, strict=True)):
        t = t.detach()
        host = None if t.is_cuda else _host_copy(t)
        if host is None:  # a GPU tensor, or a dtype numpy lacks: through DLPack
            x = jnp.array(jax.dlpack.from_dlpack(t.contiguous()), copy=True)
            out[i] = jax.device_put(x, like.sharding) if like.sharding is not None else x
            continue
        committed = bool(getattr(like, "_committed", False))  # (abstract: placed by default)
        idx, hosts, where = batches.setdefault(committed, ([], [], []))
        idx.append(i)
        hosts.append(host)
        where.append(like.sharding)
    for committed, (idx, hosts, where) in batches.items():
        placed = jax.device_put(hosts, where) if committed else jax.device_put(hosts)
        for i, x in zip(idx, placed, strict=True):
            out[i] = x
    return out


def _host_copy(t: torch.Tensor) -> np.ndarray | None:
    """A numpy copy of a CPU tensor (bfloat16 as ml_dtypes'); None for a dtype numpy lacks."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().copy().view(jnp.bfloat16)
    try:
        return t.contiguous().numpy().copy()
    except TypeError:  # (float8 and the like: through DLPack)
        return None


@functools.partial(jax.jit, static_argnums=(1,))
def _concat(leaves: list[jax.Array], extra: int) -> jax.Array:
    dt = jnp.promote_types(jnp.result_type(*leaves), jnp.float32)
    tail = [jnp.zeros(extra, dt)] if extra else []
    return jnp.concatenate([*(jnp.ravel(leaf).astype(dt) for leaf in leaves), *tail])


def to_flat(
    leaves: list[jax.Array], paths: list[str] | None = None, extra: int = 0
) -> tuple[jax.Array, torch.Tensor]:
    """The leaves in one new flat buffer, and that buffer as a torch tensor (the same
    memory: a collective that writes the tensor writes the buffer). ``paths``: the
    leaves' key paths, for errors; ``extra``: zeros after them (the step's vote:
    :mod:`fastft.runtime.state.inband`)."""
    if not leaves:
        raise ValueError("tx.pmean: the tree has no leaves")
    bad = [
        f"{paths[i] if paths else f'leaf {i}'} ({leaf.dtype})"
        for i, leaf in enumerate(leaves)
        if not jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    if bad:
        raise TypeError(
            f"tx.pmean: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} not floating "
            "point: pmean averages a gradient. An integer leaf (a step counter, a token "
            "count) is state: compute it in the step and tx.propose it (every member "
            "computes the same value from the same global batch); a sum over members of an "
            "integer is tx.allreduce([torch.from_dlpack(x)]) (psum)"
        )
    flat = _concat(leaves, extra)
    return flat, as_tensor(flat)


@functools.partial(jax.jit, static_argnums=(1,))
def _split(flat: jax.Array, layout: Layout) -> list[jax.Array]:
    out, off = [], 0
    for shape, dtype in layout:
        n = math.prod(shape)
        out.append(flat[off : off + n].reshape(shape).astype(dtype))
        off += n
    return out


def split(flat: jax.Array, layout: Layout) -> list[jax.Array]:
    """The leaves of ``layout`` read back from the flat buffer (new arrays)."""
    return list(_split(flat, layout))


def padded(part: slice, n: int, size: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """``part`` of a batch of ``n`` as ``size`` row indices (padding repeats its first row)
    and a weight per row, 1 for its own rows and 0 for the padding."""
    rows = part.stop - part.start
    if rows > size:
        raise ValueError(
            f"tx.shard_padded({n}, size={size}): this member's part has {rows} rows (a world "
            f"of {world}); size must be at least ceil(n / fewest members)"
        )
    idx = np.full(size, part.start, np.int64)
    idx[:rows] = np.arange(part.start, part.stop)
    return idx, (np.arange(size) < rows).astype(np.float32)
