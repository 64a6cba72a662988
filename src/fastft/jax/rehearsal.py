"""A JAX warm spare's rehearsal: the script run up to the end of its first step, before the
spare knows which worker it will be.

A JAX restart's cost is the program, not the parameters: the build of the state and, at
the first step, tracing every jitted function and loading its executable (3.6 s for a
4M-parameter transformer, of which the heal was 0.5 s). With ``--spare-run-ahead``, a
spare of a JAX job pays all of it ahead of time: ``fastft.jax.init()`` returns at once,
``ft.register`` builds the state, and the first ``ft.transaction()`` runs its body as
member 0 of the job's world (:data:`~fastft.process.env.SPARE_WORLD`) at step 0, with no
peer: ``tx.pmean`` returns the local tree, and the proposal is dropped. Every
function the step calls is then traced and compiled, for the shapes a member of that world
feeds it. At the end of that step the spare waits for its order; once it has it, it joins
the job as the worker it replaces (heal included) and the loop goes on at the job's step,
with nothing left to compile.

What a script must allow (``docs/jax.md``, *Warm spares*): the first step's body runs
once more in the spare, on step 0's data, and its result is dropped; ``tx.rehearsal``
(and ``ft.rehearsing``) is True there, for a step whose side effects (a file written, a
metric logged) should not happen twice.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import jax

from fastft.process.env import SPARE_FEWEST, SPARE_RUN_AHEAD, SPARE_WORLD
from fastft.protocol.shards import tile

__all__ = ["Rehearsal", "Tracing", "due"]


def due() -> bool:
    """Whether this process is a spare that runs the script ahead and has no order yet."""
    return SPARE_RUN_AHEAD in os.environ


@dataclass(frozen=True)
class Rehearsal:
    """What a rehearsed step sees: step 0, member 0 of ``world``."""

    world: int
    fewest: int = 0
    """The fewest members an epoch may have (``--min-replicas``; else ``world``)."""
    step: int = 0
    epoch: int = 0
    rank: int = 0

    @classmethod
    def from_env(cls) -> Rehearsal:
        try:
            world = max(1, int(os.environ.get(SPARE_WORLD, "1")))
            fewest = int(os.environ.get(SPARE_FEWEST, "0")) or world
        except ValueError:
            world = fewest = 1
        return cls(world=world, fewest=fewest)

    def shard(self, n: int) -> slice:
        """Member 0's part of a global batch of ``n`` (``Transaction.shard``'s tiling)."""
        if n < self.world:
            raise ValueError(f"a global batch of {n} samples cannot feed {self.world} members")
        lo, hi = tile(0, n, self.world, self.rank)
        return slice(lo, hi)


class Tracing:
    """This process's JAX traces and compile time so far (``jax.monitoring``'s events): a
    worker's first step reports what it traced and compiled, which a rehearsed spare should
    not have to (a shape, dtype or placement that differs from the rehearsal's does)."""

    _COMPILE = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )
    _lock = threading.Lock()
    traces = 0
    compile_s = 0.0
    cache_hits = 0
    """Executables the persistent compilation cache gave back."""
    cache_misses = 0
    """Executables compiled because the cache had none."""
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                jax.monitoring.register_event_duration_secs_listener(cls._on)
                jax.monitoring.register_event_listener(cls._on_event)
                cls._installed = True

    @classmethod
    def _on(cls, event: str, duration_secs: float, **_: str | int) -> None:
        if event in cls._COMPILE:
            cls.compile_s += duration_secs
            cls.traces += event == cls._COMPILE[0]

    @classmethod
    def _on_event(cls, event: str, **_: str | int) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            cls.cache_hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            cls.cache_misses += 1

    @classmethod
    def now(cls) -> tuple[int, float, int, int]:
        """(traces, compile seconds, cache hits, cache misses) so far."""
        return cls.traces, cls.compile_s, cls.cache_hits, cls.cache_misses
