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

The state may be registered as a *build* (a function that returns the pytrees by name):
its structure comes from ``jax.eval_shape`` (tracing, no computation), and the build runs
only if nothing else fills it. A worker that joins a job under way is healed and never
builds (the build was most of a JAX restart: 0.85 s of 3.6 s for a 4M-parameter
transformer); a first start builds, as does anything that reads the state first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import torch

from fastft.jax.trees import Layout, as_tensor, from_tensors, layout_of

__all__ = ["FROM_LOCALS", "NO_PROPOSAL", "PyTrees", "StateMisuse"]


class StateMisuse(ValueError):
    """The script did something to its registered pytrees that fastft cannot make safe."""


NO_PROPOSAL = (
    "step {step} ended without tx.propose(...): its update would be lost, and a member that "
    "heals would train from state the others no longer hold. Propose the step's new "
    "pytrees from ft.state every step (params kept in the script's own variables are not "
    "what a heal gives back); a step that changes nothing says so with tx.propose()"
)
FROM_LOCALS = (
    "step {step} proposed new pytrees without reading ft.state since the last step ended: "
    "they were computed from the script's own variables, which a rollback does not put "
    "back (a retried step would start from its failed attempt's update) and a heal does "
    'not fill. Read the committed state at the top of every step: ft.state["params"], ...'
)


class PyTrees:
    """Registered pytrees by name: the committed ones and the step's proposal."""

    def __init__(self) -> None:
        self._committed: dict[str, Any] = {}
        self._proposed: dict[str, Any] = {}
        self._defs: dict[str, Any] = {}
        self._paths: dict[str, list[str]] = {}
        self._layouts: dict[str, Layout] = {}
        self._build: Callable[[], Mapping[str, Any]] | None = None
        self._abstract: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.on_build: Callable[[float], None] | None = None
        """Told the milliseconds a registered build took, when it runs."""

    @property
    def committed(self) -> dict[str, Any]:
        """The committed pytrees by name (a registered build runs first if it is due)."""
        self.materialize()
        return self._committed

    @property
    def pending(self) -> bool:
        """Whether a registered build has neither run nor been replaced by a heal."""
        return self._build is not None

    def add(self, name: str, tree: Any) -> None:
        self._committed[name] = self._define(name, tree, f"ft.register({name}=...)")

    def add_build(self, build: Callable[[], Mapping[str, Any]]) -> list[str]:
        """Register the pytrees ``build()`` returns, by name, without running it (their
        structure from ``jax.eval_shape``); returns the names."""
        what = f"ft.register({getattr(build, '__name__', 'build')})"
        shapes = jax.eval_shape(build)
        if not isinstance(shapes, Mapping) or not shapes:
            raise StateMisuse(
                f"{what}: the build returned {type(shapes).__name__}, not a dict of pytrees "
                "by name; return {'params': params, 'opt': opt_state, ...}"
            )
        for name, tree in shapes.items():
            self._define(name, tree, what)
            self._abstract[name] = tree
        self._build = build
        return list(shapes)

    def defer(self) -> None:
        """Make the committed pytrees a build again (a warm spare's, at the end of its
        rehearsal): a heal replaces them without a health check reading them first, and
        a first start takes them back as they are."""
        if self._build is not None or not self._committed:
            return
        kept = dict(self._committed)
        self._abstract = dict(kept)
        self._committed = {}
        self._build = lambda: kept

    def materialize(self) -> None:
        """Run the registered build if it is still due (nothing healed or restored it)."""
        if self._build is None:
            return
        with self._lock:
            build, self._build = self._build, None
            if build is None:
                return
            t0 = time.monotonic()
            built = build()
            what = f"ft.register({getattr(build, '__name__', 'build')})"
            if not isinstance(built, Mapping) or set(built) != set(self._abstract):
                raise StateMisuse(
                    f"{what}: the build returned {sorted(built) if isinstance(built, Mapping) else type(built).__name__} "
                    f"when run, {sorted(self._abstract)} when traced; it must return the same "
                    "pytrees every time"
                )
            for name, tree in built.items():
                layout = self._layouts[name]
                self._committed[name] = self._define(name, tree, what)
                if self._layouts[name] != layout:
                    raise StateMisuse(
                        f"{what}: {name} has other shapes or dtypes when run than when "
                        "traced (jax.eval_shape); a build must not depend on values"
                    )
            self._abstract.clear()
            if self.on_build is not None:
                self.on_build(round((time.monotonic() - t0) * 1e3, 1))

    def _define(self, name: str, tree: Any, what: str) -> Any:
        """Fix ``name``'s structure and layout from ``tree``; returns it with arrays as leaves."""
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        for path, leaf in with_paths:
            if not isinstance(leaf, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
                where = f"{name}{jax.tree_util.keystr(path)}"
                raise StateMisuse(
                    f"{what}: the leaf {where} is a {type(leaf).__name__}, not an array: a "
                    "step proposes arrays of the registered shapes and dtypes, and a heal "
                    "sends arrays; register jnp.asarray(value) (a scalar as a 0-d array), "
                    "or keep a constant out of the registered state"
                )
        arrays = [
            leaf if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) else jax.numpy.asarray(leaf)
            for _, leaf in with_paths
        ]
        self._defs[name] = treedef
        self._paths[name] = [f"{name}{jax.tree_util.keystr(p)}" for p, _ in with_paths]
        self._layouts[name] = layout_of(arrays)
        return jax.tree_util.tree_unflatten(treedef, arrays)

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
                    f"tx.propose({name}=...): {self._paths[name][i]} is "
                    f"{got[i][1]}{list(got[i][0])}, registered as "
                    f"{self._layouts[name][i][1]}{list(self._layouts[name][i][0])}; the shapes "
                    "and dtypes of a registered pytree are fixed"
                )
        self.check_alive()
        self._proposed.update(trees)

    def check_alive(self) -> None:
        """Refuse a committed state whose buffers were donated (freed by JAX)."""
        for name, tree in self.committed.items():
            for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
                if leaf.is_deleted():
                    raise StateMisuse(
                        f"the committed {self._paths[name][i]} was deleted: a jitted function "
                        "it was passed to donated it (donate_argnums) or the script deleted "
                        "it. fastft keeps the committed state by reference so that a "
                        "rolled-back step costs nothing; do not donate the committed pytrees "
                        "(donate a copy, or nothing)"
                    )

    # --- ByReference ------------------------------------------------------------------------
    def commit(self) -> None:
        self._committed.update(self._proposed)
        self._proposed.clear()

    def rollback(self) -> None:
        self._proposed.clear()

    def lose(self) -> None:
        def nan(leaf: jax.Array) -> jax.Array:
            inexact = jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)
            return jax.numpy.full_like(leaf, jax.numpy.nan) if inexact else leaf

        self._committed = {k: jax.tree_util.tree_map(nan, v) for k, v in self.committed.items()}

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
        with self._lock:  # (a build still due is replaced: it never runs)
            mine = {**self._committed, **self._abstract}
            for name, tensors in state.items():
                if name not in self._defs:
                    raise ValueError(
                        f"the received state has a pytree {name!r} not registered here"
                    )
                old = jax.tree_util.tree_leaves(mine[name])
                want = layout_of([_wire_like(leaf) for leaf in old])
                got = tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)
                if got != want:
                    bad = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
                    raise ValueError(
                        f"the received {self._paths[name][bad]} is {got[bad]}, registered here "
                        f"as {want[bad]} ({len(got)} and {len(want)} leaves): every worker "
                        "must register the same pytrees"
                    )
                placed = from_tensors(list(tensors), [_wire_like(like) for like in old])
                leaves = [_unwire(x, like) for x, like in zip(placed, old, strict=True)]
                loaded[name] = jax.tree_util.tree_unflatten(self._defs[name], leaves)
            self._committed.update(loaded)
            self._proposed.clear()
            if self._build is not None and set(self._abstract) <= set(loaded):
                self._build = None
                self._abstract.clear()


def _is_key(leaf: jax.Array | jax.ShapeDtypeStruct) -> bool:
    return bool(jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _wire(leaf: jax.Array) -> jax.Array:
    """What a leaf travels as: a typed PRNG key as its key data (DLPack has no key type)."""
    return jax.random.key_data(leaf) if _is_key(leaf) else leaf


def _wire_like(leaf: Any) -> Any:
    """:func:`_wire` for a leaf that may be abstract (a registered build's, not run)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.eval_shape(jax.random.key_data, leaf) if _is_key(leaf) else leaf
    return _wire(leaf)


def _unwire(value: jax.Array, like: Any) -> jax.Array:
    """A received leaf as ``like`` is: a typed key of its implementation, weakly typed if
    ``like`` is (a leaf that changed either would make every jitted function trace again)."""
    if _is_key(like):
        impl = (
            like.dtype._impl  # noqa: SLF001 (an abstract key's: jax.random.key_impl takes arrays only)
            if isinstance(like, jax.ShapeDtypeStruct)
            else jax.random.key_impl(like)
        )
        return jax.random.wrap_key_data(value, impl=impl)
    if getattr(like, "weak_type", False) and not value.weak_type:
        from jax._src.lax.lax import _convert_element_type

        return _convert_element_type(value, value.dtype, weak_type=True)
    return value
