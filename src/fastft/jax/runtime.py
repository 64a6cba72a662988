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

from fastft.jax import rehearsal
from fastft.jax.rehearsal import Rehearsal, Tracing
from fastft.jax.state import PyTrees, StateMisuse
from fastft.jax.transaction import JaxTransaction
from fastft.runtime.api import Runtime
from fastft.runtime.api import init as init_runtime
from fastft.runtime.endings import ScriptError

__all__ = ["JaxRuntime", "init"]

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
