"""Health checks before a worker joins or rejoins the job (issue 23).

A worker runs them in :meth:`fastft.Runtime.register` (its first join, every restart, a
warm spare taking a slot) and before an in-process restart rejoins
(:meth:`fastft.Runtime.run`). One that fails is not admitted: it logs why, records a
``health_failed`` event and ends with :data:`~fastft.runtime.contract.EXIT_UNHEALTHY`;
its agent gives the slot to a warm spare, lets the elastic world shrink, or stops the
job with the reason (:func:`fastft.launch.rules.policy.after_exit`).

Built in:

* ``cuda``: where the registered model is on a GPU, a tiny kernel runs on it and
  completes, and at least :data:`CUDA_FREE_FLOOR_MB` of its memory is free;
* ``state``: the registered state (parameters, optimizer state) holds no NaN or Inf;
  skipped when the worker is about to receive the state from a peer anyway;
* ``host_memory``: at least ``--health-host-mb`` MiB (256) of host memory is available.

A user check is a callable of no arguments, added with :meth:`fastft.Runtime.add_health_check`
(or ``ft.run(..., health_check=...)``): it passes when it returns None or True, and fails
when it returns False or a string (the reason) or raises.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastft.runtime.contract import HealthCheck
from fastft.runtime.endings import Unhealthy
from fastft.runtime.state.registry import StateRegistry

if TYPE_CHECKING:
    from fastft.runtime.ports import RuntimePorts

__all__ = [
    "CUDA_FREE_FLOOR_MB",
    "CheckFailed",
    "HealthCheck",
    "admit_or_leave",
    "builtin_checks",
    "first_failure",
]

log = logging.getLogger(__name__)

CUDA_FREE_FLOOR_MB = 64
"""The ``cuda`` check's floor of free GPU memory (an allocator that cannot find this much
is not going to run a step)."""


@dataclass(frozen=True)
class CheckFailed:
    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.name}: {self.why}"


def first_failure(checks: Iterable[tuple[str, HealthCheck]]) -> CheckFailed | None:
    """Run ``checks`` (name, callable) in order; the first that fails, or None."""
    for name, check in checks:
        try:
            got = check()
        except Exception as e:
            return CheckFailed(name, f"raised {type(e).__name__}: {e}"[:500])
        if got is False:
            return CheckFailed(name, "returned False")
        if isinstance(got, str):
            return CheckFailed(name, got[:500])
    return None


def builtin_checks(
    registry: StateRegistry, *, host_floor_mb: int, check_state: bool
) -> list[tuple[str, HealthCheck]]:
    """The built-in checks for a worker whose state is ``registry`` (see the module)."""
    checks: list[tuple[str, HealthCheck]] = []
    device = _cuda_device(registry)
    if device is not None:
        checks.append(("cuda", lambda: _cuda_ok(device)))
    if check_state:
        checks.append(("state", lambda: state_damage(registry)))
    if host_floor_mb > 0:
        checks.append(("host_memory", lambda: _host_memory(host_floor_mb)))
    return checks


def _cuda_device(registry: StateRegistry) -> torch.device | None:
    if registry.model is None or not torch.cuda.is_available():
        return None
    for p in registry.model.parameters():
        if p.device.type == "cuda":
            return p.device
    return None


def _cuda_ok(device: torch.device) -> str | None:
    x = torch.arange(1024, device=device, dtype=torch.float32)
    got = float((x * 2).sum().item())  # a kernel launched and completed (.item syncs)
    if got != 1024 * 1023:
        return f"a test kernel on {device} computed {got}, not {1024 * 1023}"
    free, _ = torch.cuda.mem_get_info(device)
    if free < CUDA_FREE_FLOOR_MB << 20:
        return f"{device} has {free >> 20} MiB free (< {CUDA_FREE_FLOOR_MB} MiB)"
    return None


def state_damage(registry: StateRegistry) -> str | None:
    """Where the registered state holds NaN or Inf (damaged for sure); None if nowhere."""
    for where, t in _state_tensors(registry):
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return f"{where} holds NaN or Inf"
    return None


def _state_tensors(registry: StateRegistry) -> Iterator[tuple[str, torch.Tensor]]:
    if registry.model is not None:
        for name, p in registry.model.named_parameters():
            yield f"parameter {name}", p.detach()
    if registry.optimizer is not None:
        for key, st in registry.optimizer.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    yield f"optimizer state {k} of parameter {_short(key)}", v
    ref = registry.by_reference
    if ref is not None and not ref.pending:  # (fastft.jax: a build not
        # run yet has nothing to check: a heal replaces it, or it is built after the join)
        for name, leaves in ref.state_dict().items():
            for i, t in enumerate(leaves):
                yield f"{name} leaf {i}", t


def _short(key: object) -> str:
    if isinstance(key, torch.Tensor):
        return f"of shape {tuple(key.shape)}"
    return str(key)


def _host_memory(floor_mb: int) -> str | None:
    avail = _mem_available_mb()
    if avail is None or avail >= floor_mb:
        return None  # (unreadable: no verdict)
    return f"{avail} MiB of host memory available (< --health-host-mb {floor_mb})"


def _mem_available_mb() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def admit_or_leave(
    rt: RuntimePorts, *, check_state: bool, extra: Iterable[tuple[str, HealthCheck]] = ()
) -> None:
    """Run the worker's health checks (built in, the user's added ones, ``extra``) before
    it joins or rejoins; one that fails ends the worker (:class:`Unhealthy`): it logs why,
    records ``health_failed``, and leaves the job without being admitted."""
    t0 = time.monotonic()
    checks = [
        *builtin_checks(
            rt.registry, host_floor_mb=rt.config.health_host_mb, check_state=check_state
        ),
        *rt.health_checks,
        *extra,
    ]
    failed = first_failure(checks)
    ms = round((time.monotonic() - t0) * 1e3, 3)
    if failed is None:
        rt.events.emit("health_ok", checks=[n for n, _ in checks], check_ms=ms)
        return
    rt.events.emit("health_failed", check=failed.name, reason=failed.why, step=rt.step)
    log.error("rank %d failed its health check (%s); it is not admitted", rt.rank, failed)
    print(f"fastft: rank {rt.rank} failed its health check: {failed}", file=sys.stderr, flush=True)
    rt.close(finished=False)  # (not the job's end: a member may be leaving here)
    raise Unhealthy(str(failed))
