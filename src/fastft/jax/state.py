"""The committed JAX state, kept by reference (:class:`~fastft.runtime.state.registry.ByReference`).

JAX state is functional: a step computes new pytrees from the committed ones and leaves
those untouched. So a transaction *proposes* its new pytrees (``tx.propose``), a commit
adopts them, and a rollback drops them: nothing is snapshotted or undone, whatever the
state's size. The one way to break that is to donate a committed buffer to a jitted
function (``donate_argnums``): JAX then frees it, and a rollback would have nothing to
return to. :class:`PyTrees` refuses such a state, with that reason, instead of training on.

A pytree's structure (its treedef) and its leaves' shapes and dtypes are fixed when it is
registered: a proposal must keep them, and a heal or a checkpoint fills the receiver's own
structure from a list of leaves (no pickle crosses the wire).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from fastft.jax.trees import Layout, as_tensor, from_tensor, layout_of

__all__ = ["PyTrees", "StateMisuse"]


class StateMisuse(ValueError):
    """The script did something to its registered pytrees that fastft cannot make safe."""


class PyTrees:
    """Registered pytrees by name: the committed ones and the step's proposal."""

    def __init__(self) -> None:
        self.committed: dict[str, Any] = {}
        self._proposed: dict[str, Any] = {}
        self._defs: dict[str, Any] = {}
        self._layouts: dict[str, Layout] = {}

    def add(self, name: str, tree: Any) -> None:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        for path, leaf in with_paths:
            if not isinstance(leaf, jax.Array | np.ndarray):
                where = f"{name}{jax.tree_util.keystr(path)}"
                raise StateMisuse(
                    f"ft.register({name}=...): the leaf {where} is a {type(leaf).__name__}, "
                    "not an array: a step proposes arrays of the registered shapes and dtypes, "
                    "and a heal sends arrays; register jnp.asarray(value) (a scalar as a "
                    "0-d array), or keep a constant out of the registered state"
                )
        leaves = [leaf for _, leaf in with_paths]
        arrays = [
            leaf if isinstance(leaf, jax.Array) else jax.numpy.asarray(leaf) for leaf in leaves
        ]
        self._defs[name] = treedef
        self._layouts[name] = layout_of(arrays)
        self.committed[name] = jax.tree_util.tree_unflatten(treedef, arrays)

    def propose(self, trees: dict[str, Any]) -> None:
        for name, tree in trees.items():
            if name not in self._defs:
                raise StateMisuse(
                    f"tx.propose({name}=...): no pytree {name!r} is registered (registered: "
                    f"{', '.join(sorted(self._defs)) or 'none'}); register it with "
                    f"ft.register({name}=...) before the first step"
                )
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            if treedef != self._defs[name]:
                raise StateMisuse(
                    f"tx.propose({name}=...): its tree structure differs from the registered "
                    f"one ({treedef} vs {self._defs[name]}); a heal fills the receiver's own "
                    "structure, so it cannot change between steps"
                )
            got = layout_of(leaves)
            if got != self._layouts[name]:
                i = next(
                    i
                    for i, (a, b) in enumerate(zip(got, self._layouts[name], strict=True))
                    if a != b
                )
                raise StateMisuse(
                    f"tx.propose({name}=...): leaf {i} is {got[i][1]}{list(got[i][0])}, "
                    f"registered as {self._layouts[name][i][1]}{list(self._layouts[name][i][0])}"
                    "; the shapes and dtypes of a registered pytree are fixed"
                )
        self.check_alive()
        self._proposed.update(trees)

    def check_alive(self) -> None:
        """Refuse a committed state whose buffers were donated (freed by JAX)."""
        for name, tree in self.committed.items():
            for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
                if leaf.is_deleted():
                    raise StateMisuse(
                        f"the committed {name!r} (leaf {i}) was deleted: a jitted function "
                        "it was passed to donated it (donate_argnums) or the script deleted "
                        "it. fastft keeps the committed state by reference so that a "
                        "rolled-back step costs nothing; do not donate the committed pytrees "
                        "(donate a copy, or nothing)"
                    )

    # --- ByReference ------------------------------------------------------------------------
    def commit(self) -> None:
        self.committed.update(self._proposed)
        self._proposed.clear()

    def rollback(self) -> None:
        self._proposed.clear()

    def lose(self) -> None:
        def nan(leaf: jax.Array) -> jax.Array:
            inexact = jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)
            return jax.numpy.full_like(leaf, jax.numpy.nan) if inexact else leaf

        self.committed = {k: jax.tree_util.tree_map(nan, v) for k, v in self.committed.items()}

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        self.check_alive()
        return {
            name: [as_tensor(_wire(leaf)) for leaf in jax.tree_util.tree_leaves(tree)]
            for name, tree in self.committed.items()
        }

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        missing = sorted(set(self._defs) - set(state))
        if missing:
            raise ValueError(f"the received state has no pytree {', '.join(missing)}")
        loaded = {}
        for name, tensors in state.items():
            if name not in self._defs:
                raise ValueError(f"the received state has a pytree {name!r} not registered here")
            old = jax.tree_util.tree_leaves(self.committed[name])
            want = layout_of([_wire(leaf) for leaf in old])
            got = tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)
            if got != want:
                raise ValueError(
                    f"the received {name!r} has leaves {got}, registered here as {want}: "
                    "every worker must register the same pytrees"
                )
            leaves = [
                _unwire(from_tensor(t, _wire(like)), like)
                for t, like in zip(tensors, old, strict=True)
            ]
            loaded[name] = jax.tree_util.tree_unflatten(self._defs[name], leaves)
        self.committed.update(loaded)
        self._proposed.clear()


def _is_key(leaf: jax.Array) -> bool:
    return bool(jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _wire(leaf: jax.Array) -> jax.Array:
    """What a leaf travels as: a typed PRNG key as its key data (DLPack has no key type)."""
    return jax.random.key_data(leaf) if _is_key(leaf) else leaf


def _unwire(value: jax.Array, like: jax.Array) -> jax.Array:
    if not _is_key(like):
        return value
    return jax.random.wrap_key_data(value, impl=jax.random.key_impl(like))
