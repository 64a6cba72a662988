"""One attempt of one JAX step (:class:`JaxTransaction`): the torch transaction's, plus the
JAX step's own (``tx.key``, ``tx.pmean``, ``tx.propose``) and a warm spare's rehearsal of
the first step. It sees the worker through :class:`JaxWorker` (which
:class:`~fastft.jax.runtime.JaxRuntime` is)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import jax
import numpy as np
import torch

from fastft.jax.rehearsal import Rehearsal
from fastft.jax.state import FROM_LOCALS, NO_PROPOSAL, PyTrees, StateMisuse
from fastft.jax.trees import layout_of, padded, split, to_flat
from fastft.runtime.api import Runtime
from fastft.runtime.endings import ScriptError
from fastft.runtime.state.inband import SLOTS
from fastft.runtime.sync import reduce_flat
from fastft.runtime.transaction import Transaction

__all__ = ["JaxTransaction", "JaxWorker"]

log = logging.getLogger(__name__)


class JaxWorker(Protocol):
    """The JAX worker as its transactions see it."""

    trees: PyTrees
    read_state: bool
    rehearsal: Rehearsal | None
    key: jax.Array

    @property
    def rt(self) -> Runtime: ...

    def promote(self) -> None: ...

    def first_step_done(self, tx: JaxTransaction) -> None: ...


class JaxTransaction:
    """One attempt of one step (see :class:`fastft.Transaction`): ``step``, ``epoch``,
    ``rank``, ``world``, ``shard(n)``, ``committed``, plus the JAX step's own:
    :attr:`key`, :meth:`pmean` and :meth:`propose`. In a warm spare's rehearsal
    (``tx.rehearsal``, :mod:`fastft.jax.rehearsal`) it is step 0 of member 0, alone."""

    def __init__(self, ft: JaxWorker, tx: Transaction | None) -> None:
        self.ft = ft
        self.tx = tx
        self.proposed = False
        """Whether this attempt proposed (once: a second :meth:`propose` is refused)."""
        self._rehearsed = ft.rehearsal if tx is None else None
        """The rehearsal this attempt ran in: what it reads after the block too, once the
        spare was promoted (the runtime's rehearsal is None then; ``tx.step`` after the
        ``with`` block raised AttributeError, and the promoted spare restarted cold)."""

    @property
    def rehearsal(self) -> bool:
        """Whether this is a warm spare's rehearsal of the first step: nothing it computes
        is kept, and it has no peers."""
        return self.tx is None

    def __enter__(self) -> JaxTransaction:
        try:
            self.ft.trees.check_alive()
        except StateMisuse as e:
            self._misuse(e)
        if self.tx is not None:
            self.tx.__enter__()
        self.proposed = False
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        if et is None and not self.proposed and self.ft.trees.committed:
            try:
                raise StateMisuse(NO_PROPOSAL.format(step=self.step))
            except StateMisuse as e:
                self._misuse(e)
        if self.tx is None:  # the rehearsal: its proposal dropped, then the order awaited
            self.ft.trees.rollback()
            if et is None:
                self.ft.promote()
            return False
        try:
            return self.tx.__exit__(et, ev, tb)
        finally:
            self.ft.read_state = False  # (the next step reads what this one left)
            self.ft.first_step_done(self)

    def _at(self, name: str) -> int:
        if self.tx is None and self._rehearsed is not None:
            return int(getattr(self._rehearsed, name))
        return int(getattr(self.tx, name))

    @property
    def step(self) -> int:
        return self._at("step")

    @property
    def epoch(self) -> int:
        return self._at("epoch")

    @property
    def rank(self) -> int:
        return self._at("rank")

    @property
    def world(self) -> int:
        return self._at("world")

    @property
    def committed(self) -> bool:
        return self.tx is not None and self.tx.committed

    @property
    def key(self) -> jax.Array:
        """This attempt's PRNG key: the job's seed folded with the step, then with this
        member's rank in the epoch. A retried step draws the same numbers as its first
        attempt, and a restarted worker what it would have drawn."""
        return jax.random.fold_in(jax.random.fold_in(self.ft.key, self.step), self.rank)

    def shard(self, n: int) -> slice:
        """This member's part of the step's global batch (:meth:`fastft.Transaction.shard`);
        :meth:`pmean` then weighs each member's gradient by its share."""
        if self.tx is None:
            assert self.ft.rehearsal is not None
            return self.ft.rehearsal.shard(n)
        return self.tx.shard(n)

    def shard_padded(self, n: int, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """This member's part of the step's global batch of ``n`` as a fixed number of row
        indices and a weight per row (1 for its rows, 0 for padding), so that the step's
        shapes do not change with the world: an elastic world that shrinks or grows, a
        member that gets one row more than another, and a warm spare's rehearsal all use
        the executables already compiled. ``size`` (default): the most rows a member can
        get, ``ceil(n / fewest members)`` (``--min-replicas``, else the job's world). Use the
        weights in the loss, a mean over this member's rows (``(loss * w).sum() /
        w.sum()``); :meth:`pmean` weighs members by their shares as with :meth:`shard`. The
        price: at the full world a member computes ``size`` rows for its ``n / world``."""
        if self.tx is None:
            fewest = self.ft.rehearsal.fewest if self.ft.rehearsal is not None else 1
        else:
            cfg = self.ft.rt.config
            fewest = cfg.min_replicas or cfg.world_size
        return padded(self.shard(n), n, size or -(-n // max(1, fewest)), self.world)

    def pmean(self, tree: Any) -> Any:
        """The **mean** of the pytree ``tree`` (a gradient) over the epoch's members, as a
        new pytree of the same structure, shapes and dtypes (``jax.lax.pmean`` over the
        job, not ``psum``): weighted by the members' shares when :meth:`shard` was used, so
        the result is the gradient of the mean loss over the whole global batch. One flat
        buffer, reduced in place by the epoch's collective (interruptible: a peer's fault
        ends the step here). Floating-point leaves only: a gradient has no integers (an
        integer count is state the step computes and proposes, or reduced with
        :meth:`allreduce` as a torch tensor)."""
        rt = None if self.tx is None else self.ft.rt
        if rt is not None:
            rt.injector.fire_due(self.step, point="collective")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        # (the step's vote rides the buffer's last SLOTS elements, a rehearsal's too: the
        # promoted spare's buffer then has the shape its functions were compiled for)
        flat, t = to_flat(
            [leaf for _, leaf in leaves], [jax.tree_util.keystr(p) for p, _ in leaves], SLOTS
        )
        if rt is not None:  # (a rehearsal has no peers: its own tree is the mean)
            reduce_flat(rt, t, SLOTS)
            if t.is_cuda:  # (JAX reads the buffer on its own stream: the sum must be there)
                torch.cuda.current_stream(t.device).synchronize()
        layout = layout_of([leaf for _, leaf in leaves])
        return jax.tree_util.tree_unflatten(treedef, split(flat, layout))

    allreduce_tree = pmean
    """The name :meth:`pmean` had first (it is the mean, as ``jax.lax.pmean``)."""

    def allreduce(self, tensors: list[Any]) -> None:
        """:meth:`fastft.Transaction.allreduce`: **sum** torch tensors in place (as
        ``jax.lax.psum``); in a rehearsal, nothing."""
        if self.tx is not None:
            self.tx.allreduce(tensors)

    def propose(self, **trees: Any) -> None:
        """This step's new pytrees, by their registered names: adopted when the step
        commits on every member, dropped when it rolls back. A name not proposed keeps
        its committed value."""
        try:
            if self.proposed:
                raise StateMisuse(
                    f"tx.propose called twice in step {self.step}: a second call would merge "
                    "silently into the first; propose every new pytree in one call, "
                    "tx.propose(params=..., opt=...)"
                )
            if trees and self.tx is not None and not self.ft.read_state:
                raise StateMisuse(FROM_LOCALS.format(step=self.step))
            self.ft.trees.propose(trees)
        except StateMisuse as e:
            self._misuse(e)
        self.proposed = True

    def _misuse(self, e: StateMisuse) -> None:
        why = str(e)
        if self.tx is not None:
            self.ft.rt.events.emit("script_error", step=self.step, error=why)
        log.critical("%s", why)
        raise ScriptError(why) from e
