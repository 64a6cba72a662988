"""fastft for JAX: JAX computes, fastft communicates.

Each worker is a single-controller JAX program over its own devices (no
``jax.distributed``, no cross-process XLA collective); what crosses processes is fastft's:
the error bus, the per-step decision, the gradient's reduction (interruptible), rollback,
heal, re-formation, spares and the durable tier, so S1-S5 hold for a JAX job as for a
torch one. :class:`JaxRuntime` is :class:`fastft.Runtime` with JAX's state kept by
reference (:mod:`fastft.jax.state`)::

    ft = fastft.jax.init()
    ft.register(build)                                   # build() -> {"params": ..., "opt": ...}
    while ft.step < steps:
        with ft.transaction() as tx:
            x, y = batch(tx.step)
            mine = tx.shard(len(x))                      # this member's samples
            grads = grad_fn(ft.state["params"], x[mine], y[mine])
            grads = tx.pmean(grads)                      # the mean over the epoch
            params, opt_state = update(ft.state["params"], ft.state["opt"], grads)
            tx.propose(params=params, opt=opt_state)     # adopted if the step commits

A warm spare that runs ahead rehearses the first step (:mod:`fastft.jax.rehearsal`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import jax
import numpy as np
import torch

from fastft.jax import rehearsal
from fastft.jax.rehearsal import Rehearsal, Tracing
from fastft.jax.state import FROM_LOCALS, NO_PROPOSAL, PyTrees, StateMisuse
from fastft.jax.trees import layout_of, padded, split, to_flat
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

    def __init__(
        self,
        rt: Runtime | None,
        rehearsing: Rehearsal | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.trees = PyTrees()
        self.read_state = False  # (:attr:`state` read since the last step ended)
        self.rehearsal = rehearsing
        """A warm spare's rehearsal of the first step, until its order (else None)."""
        self._rt: Runtime | None = None
        self._overrides = dict(overrides or {})
        self._others: dict[str, Any] | None = None
        self._checks: list[tuple[Callable[[], Any], str | None]] = []
        self.key = jax.random.key(0)
        """The job's base key: ``tx.key`` is it folded with the step and the member."""
        self._joined: tuple[int, float, int, int] | None = None
        """JAX's traces and compile seconds when this worker joined, until its first step."""
        Tracing.install()
        if rt is not None:
            self._attach(rt)

    def _attach(self, rt: Runtime) -> None:
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
        self._rt = rt
        rt.registry.by_reference = self.trees
        self.trees.on_build = lambda ms: rt.events.emit("jax_build", ms=ms)
        self.key = jax.random.key(cfg.seed)
        for check, name in self._checks:
            rt.add_health_check(check, name)

    @property
    def rt(self) -> Runtime:
        """The worker's :class:`fastft.Runtime` (a rehearsing spare waits for its order here)."""
        if self._rt is None:
            self.promote()
        assert self._rt is not None
        return self._rt

    @property
    def rehearsing(self) -> bool:
        """Whether this is a warm spare rehearsing the first step (its result is dropped)."""
        return self.rehearsal is not None

    def promote(self) -> None:
        """The rehearsal is over: wait for the order, become that worker and join the job
        with the state registered during the rehearsal (healed if the job is under way)."""
        rt = init_runtime(**self._overrides)  # (waits for the agent's order)
        self.rehearsal = None
        _compilation_cache(rt)
        self._attach(rt)
        if self._others is not None:
            self.trees.defer()  # (a heal replaces the spare's own build unread)
            self._join(self._others)

    def register(
        self, build: Callable[[], Mapping[str, Any]] | None = None, /, **named: Any
    ) -> JaxRuntime:
        """Register the state a step replaces, by name, then join the job: returns once
        this worker is a member of an epoch and holds the committed state (healed from a
        peer or restored from a checkpoint if the job is under way).

        - ``build``: a function that returns the pytrees by name (``{"params": ...,
          "opt": ...}``); it runs only if nothing else fills them: a worker that joins a
          job under way is healed and never builds (the cheaper restart).
        - keywords: pytrees of JAX arrays (parameters, optimizer state), and objects with
          ``state_dict``/``load_state_dict`` (a data position: :class:`fastft.Batches`)."""
        others = {}
        try:
            if build is not None:
                for name in self.trees.add_build(build):
                    if name in named:
                        raise StateMisuse(
                            f"ft.register: {name!r} is both built and passed by keyword"
                        )
            for name, obj in named.items():
                if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                    others[name] = obj
                else:
                    self.trees.add(name, obj)
        except StateMisuse as e:
            if self._rt is None:
                raise ScriptError(str(e)) from e
            self.rt.refuse(str(e), e)
        if self.rehearsal is not None:  # (the step to rehearse needs values)
            self.trees.materialize()
            self._others = others
            return self
        self._join(others)
        return self

    def _join(self, others: dict[str, Any]) -> None:
        try:
            self.rt.register(**others)
            self.trees.materialize()  # nothing healed or restored it: a first start builds
        except StateMisuse as e:
            self.rt.refuse(str(e), e)
        self._joined = Tracing.now()

    def first_step_done(self, tx: JaxTransaction) -> None:
        """Record what this worker's first step traced and compiled (``jax_first_step``)."""
        if self._joined is None:
            return
        traces, secs, hits, misses = Tracing.now()
        self.rt.events.emit(
            "jax_first_step",
            step=tx.step,
            traces=traces - self._joined[0],
            compile_ms=round((secs - self._joined[1]) * 1e3, 1),
            cache_hits=hits - self._joined[2],
            cache_misses=misses - self._joined[3],
            ran_ahead=self._others is not None,
        )
        self._joined = None

    @property
    def state(self) -> Mapping[str, Any]:
        """The committed pytrees by name (read-only; a step proposes new ones)."""
        self.read_state = True
        return MappingProxyType(self.trees.committed)

    def transaction(self) -> JaxTransaction:
        """``with ft.transaction() as tx:`` one step: commits on every member or on none."""
        if self.rehearsal is not None:
            return JaxTransaction(self, None)
        return JaxTransaction(self, self.rt.transaction())

    def run(self, fn: Callable[..., T], *args: Any, **options: Any) -> T:
        """:meth:`fastft.Runtime.run`: the training loop restarted in this process."""
        return self.rt.run(fn, *args, **options)

    @property
    def step(self) -> int:
        return self.rehearsal.step if self.rehearsal is not None else self.rt.step

    @property
    def epoch(self) -> int:
        return self.rehearsal.epoch if self.rehearsal is not None else self.rt.epoch

    @property
    def elapsed_s(self) -> float:
        """:attr:`fastft.Runtime.elapsed_s`: seconds since the job began."""
        return 0.0 if self.rehearsal is not None else self.rt.elapsed_s

    @property
    def world(self) -> int:
        return self.rehearsal.world if self.rehearsal is not None else self.rt.world

    @property
    def rank(self) -> int:
        return self.rehearsal.rank if self.rehearsal is not None else self.rt.rank

    @property
    def commits(self) -> int:
        return 0 if self.rehearsal is not None else self.rt.commits

    @property
    def rollbacks(self) -> int:
        return 0 if self.rehearsal is not None else self.rt.rollbacks

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
        if self._rt is None:  # (a rehearsing spare: added when it becomes a worker)
            self._checks.append((check, name))
        else:
            self._rt.add_health_check(check, name)

    def close(self, *, finished: bool = True) -> None:
        self.rt.close(finished=finished)

    def __enter__(self) -> JaxRuntime:
        return self

    def __exit__(self, et: object, *exc: object) -> None:
        self.rt.__exit__(et, *exc)


class JaxTransaction:
    """One attempt of one step (see :class:`fastft.Transaction`): ``step``, ``epoch``,
    ``rank``, ``world``, ``shard(n)``, ``committed``, plus the JAX step's own:
    :attr:`key`, :meth:`pmean` and :meth:`propose`. In a warm spare's rehearsal
    (``tx.rehearsal``, :mod:`fastft.jax.rehearsal`) it is step 0 of member 0, alone."""

    def __init__(self, ft: JaxRuntime, tx: Transaction | None) -> None:
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
        flat, t = to_flat(
            [leaf for _, leaf in leaves], [jax.tree_util.keystr(p) for p, _ in leaves]
        )
        if rt is not None:  # (a rehearsal has no peers: its own tree is the mean)
            reduce_flat(rt, t)
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


def init(**overrides: Any) -> JaxRuntime:
    """Start fastft in this JAX worker (:func:`fastft.init`); call it before the script's
    first jitted function. Unless the script chose a place, JAX's persistent compilation
    cache goes to the run directory, one per rank (JAX writes an entry in place: workers
    that compile the same function at once read each other's half-written entries), so
    that a restarted worker loads its compiled functions instead of compiling them. In a
    warm spare that runs ahead, returns at once: the spare rehearses the first step
    (:mod:`fastft.jax.rehearsal`) and becomes a worker at its end."""
    if rehearsal.due():
        return JaxRuntime(None, Rehearsal.from_env(), overrides)
    rt = init_runtime(**overrides)
    _compilation_cache(rt)
    return JaxRuntime(rt)


def _compilation_cache(rt: Runtime) -> None:
    if rt.config.run_dir and not (
        os.environ.get("JAX_COMPILATION_CACHE_DIR")
        or getattr(jax.config, "jax_compilation_cache_dir", None)
    ):
        where = os.path.join(rt.config.run_dir, "jax-cache", f"rank-{rt.rank}")
        jax.config.update("jax_compilation_cache_dir", where)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
