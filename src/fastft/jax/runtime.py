"""fastft for JAX: JAX computes, fastft communicates.

Each worker is a single-controller JAX program over its own devices (no
``jax.distributed``, no cross-process XLA collective); what crosses processes is fastft's:
the error bus, the per-step decision, the gradient's reduction (interruptible), rollback,
heal, re-formation, spares and the durable tier, so S1-S5 hold for a JAX job as for a
torch one. :class:`JaxRuntime` is :class:`fastft.Runtime` with JAX's state kept by
reference (:mod:`fastft.jax.state`)::

    ft = fastft.jax.init()
    ft.register(params=params, opt=opt_state)
    while ft.step < steps:
        with ft.transaction() as tx:
            x, y = batch(tx.step)
            mine = tx.shard(len(x))                      # this member's samples
            grads = grad_fn(ft.state["params"], x[mine], y[mine])
            grads = tx.allreduce_tree(grads)             # the mean over the epoch
            params, opt_state = update(ft.state["params"], ft.state["opt"], grads)
            tx.propose(params=params, opt=opt_state)     # adopted if the step commits
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import jax
import torch

from fastft.jax.state import PyTrees, StateMisuse
from fastft.jax.trees import layout_of, split, to_flat
from fastft.runtime.api import Runtime
from fastft.runtime.api import init as init_runtime
from fastft.runtime.endings import ScriptError
from fastft.runtime.sync import reduce_flat
from fastft.runtime.transaction import Transaction

__all__ = ["JaxRuntime", "JaxTransaction", "init"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class JaxRuntime:
    """fastft on one JAX worker. Build it with :func:`init`."""

    def __init__(self, rt: Runtime) -> None:
        cfg = rt.config
        if cfg.sync_kind != "per-step" or cfg.shard_size > 1 or rt.flow is not None:
            why = (
                f"fastft.jax: --sync {cfg.sync}, --shard-size {cfg.shard_size}"
                f"{', --stage' if rt.flow is not None else ''}: a JAX job syncs its gradient "
                "at every step over every member (--sync per-step, --shard-size 1, no "
                "pipeline stages); those policies are the torch runtime's"
            )
            rt.events.emit("script_error", step=rt.step, error=why)
            log.critical("%s", why)
            rt.close(finished=False)
            raise ScriptError(why)
        self.rt = rt
        self.trees = PyTrees()
        rt.registry.by_reference = self.trees
        self.key = jax.random.key(rt.config.seed)
        """The job's base key: ``tx.key`` is it folded with the step and the member."""

    def register(self, **named: Any) -> JaxRuntime:
        """Register the state a step replaces (pytrees of JAX arrays: parameters, the
        optimizer's state) and objects with ``state_dict``/``load_state_dict`` (a data
        position: :class:`fastft.Batches`), by name; then join the job: returns once this
        worker is a member of an epoch and holds the committed state (healed from a peer
        or restored from a checkpoint if the job is under way)."""
        others = {}
        for name, obj in named.items():
            if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                others[name] = obj
                continue
            try:
                self.trees.add(name, obj)
            except StateMisuse as e:
                self.rt.refuse(str(e), e)
        self.rt.register(**others)
        return self

    @property
    def state(self) -> Mapping[str, Any]:
        """The committed pytrees by name (read-only; a step proposes new ones)."""
        return MappingProxyType(self.trees.committed)

    def transaction(self) -> JaxTransaction:
        """``with ft.transaction() as tx:`` one step: commits on every member or on none."""
        return JaxTransaction(self, self.rt.transaction())

    def run(self, fn: Callable[..., T], *args: Any, **options: Any) -> T:
        """:meth:`fastft.Runtime.run`: the training loop restarted in this process."""
        return self.rt.run(fn, *args, **options)

    @property
    def step(self) -> int:
        return self.rt.step

    @property
    def epoch(self) -> int:
        return self.rt.epoch

    @property
    def elapsed_s(self) -> float:
        """:attr:`fastft.Runtime.elapsed_s`: seconds since the job began."""
        return self.rt.elapsed_s

    @property
    def world(self) -> int:
        return self.rt.world

    @property
    def rank(self) -> int:
        return self.rt.rank

    @property
    def commits(self) -> int:
        return self.rt.commits

    @property
    def rollbacks(self) -> int:
        return self.rt.rollbacks

    @property
    def config(self) -> Any:
        return self.rt.config

    def digest(self) -> str:
        return self.rt.digest()

    def drain(self, reason: str = "ft.drain()") -> None:
        self.rt.drain(reason)

    def no_hang_check(self) -> Any:
        return self.rt.no_hang_check()

    def add_health_check(self, check: Callable[[], Any], name: str | None = None) -> None:
        self.rt.add_health_check(check, name)

    def close(self, *, finished: bool = True) -> None:
        self.rt.close(finished=finished)

    def __enter__(self) -> JaxRuntime:
        return self

    def __exit__(self, et: object, *exc: object) -> None:
        self.rt.__exit__(et, *exc)


class JaxTransaction:
    """One attempt of one step (see :class:`fastft.Transaction`): ``step``, ``epoch``,
    ``rank``, ``world``, ``shard(n)``, ``committed``, plus the JAX step's own:
    :attr:`key`, :meth:`allreduce_tree` and :meth:`propose`."""

    def __init__(self, ft: JaxRuntime, tx: Transaction) -> None:
        self.ft = ft
        self.tx = tx
        self.proposed = False
        """Whether this attempt proposed (once: a second :meth:`propose` is refused)."""

    def __enter__(self) -> JaxTransaction:
        try:
            self.ft.trees.check_alive()
        except StateMisuse as e:
            self._misuse(e)
        self.tx.__enter__()
        self.proposed = False
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        if et is None and not self.proposed and self.ft.trees.committed:
            try:
                raise StateMisuse(
                    f"step {self.step} ended without tx.propose(...): its update would be "
                    "lost, and a member that heals would train from state the others no "
                    "longer hold. Propose the step's new pytrees from ft.state every step "
                    "(params kept in the script's own variables are not what a heal gives "
                    "back); a step that changes nothing says so with tx.propose()"
                )
            except StateMisuse as e:
                self._misuse(e)
        return self.tx.__exit__(et, ev, tb)

    @property
    def step(self) -> int:
        return self.tx.step

    @property
    def epoch(self) -> int:
        return self.tx.epoch

    @property
    def rank(self) -> int:
        return self.tx.rank

    @property
    def world(self) -> int:
        return self.tx.world

    @property
    def committed(self) -> bool:
        return self.tx.committed

    @property
    def key(self) -> jax.Array:
        """This attempt's PRNG key: the job's seed folded with the step, then with this
        member's rank in the epoch. A retried step draws the same numbers as its first
        attempt, and a restarted worker what it would have drawn."""
        return jax.random.fold_in(jax.random.fold_in(self.ft.key, self.step), self.rank)

    def shard(self, n: int) -> slice:
        """This member's part of the step's global batch (:meth:`fastft.Transaction.shard`);
        :meth:`allreduce_tree` then weighs each member's gradient by its share."""
        return self.tx.shard(n)

    def allreduce_tree(self, tree: Any) -> Any:
        """The mean of the pytree ``tree`` (a gradient) over the epoch's members, as a new
        pytree of the same structure, shapes and dtypes: weighted by the members' shares
        when :meth:`shard` was used. One flat buffer, reduced in place by the epoch's
        collective (interruptible: a peer's fault ends the step here)."""
        rt = self.ft.rt
        rt.injector.fire_due(self.step, point="collective")
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        flat, t = to_flat(leaves)
        reduce_flat(rt, t)
        if t.is_cuda:  # (JAX reads the buffer on its own stream: the sum must be there)
            torch.cuda.current_stream(t.device).synchronize()
        return jax.tree_util.tree_unflatten(treedef, split(flat, layout_of(leaves)))

    def allreduce(self, tensors: list[Any]) -> None:
        """:meth:`fastft.Transaction.allreduce`: sum torch tensors in place."""
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
            self.ft.trees.propose(trees)
        except StateMisuse as e:
            self._misuse(e)
        self.proposed = True

    def _misuse(self, e: StateMisuse) -> None:
        why = str(e)
        self.ft.rt.events.emit("script_error", step=self.step, error=why)
        log.critical("%s", why)
        raise ScriptError(why) from e


def init(**overrides: Any) -> JaxRuntime:
    """Start fastft in this JAX worker (:func:`fastft.init`); call it before the script's
    first jitted function. Unless the script chose a place, JAX's persistent compilation
    cache goes to the run directory, one per rank (JAX writes an entry in place: workers
    that compile the same function at once read each other's half-written entries), so
    that a restarted worker loads its compiled functions instead of compiling them."""
    rt = init_runtime(**overrides)
    if rt.config.run_dir and not (
        os.environ.get("JAX_COMPILATION_CACHE_DIR")
        or getattr(jax.config, "jax_compilation_cache_dir", None)
    ):
        where = os.path.join(rt.config.run_dir, "jax-cache", f"rank-{rt.rank}")
        jax.config.update("jax_compilation_cache_dir", where)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return JaxRuntime(rt)
