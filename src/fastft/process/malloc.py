"""Fixed glibc malloc thresholds for training processes on the CPU.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with a fresh ``mmap``
and returns it with ``munmap`` when freed; the threshold starts at 128 KiB and rises to
the size of the largest mapped chunk freed so far (up to 32 MiB). A training step
allocates and frees tensors of a few MB (activations, gradients, the optimizer's
temporaries), so whether each step maps them anew, and page-faults every byte, depends
on what the process happened to free earlier. Measured here (3 workers, 4.2M-parameter
MLP, 2 cores): a heal that stopped freeing a 17 MB buffer at start-up made every step
~8 ms of CPU slower on every worker (60 -> 70 ms per step), with nothing else changed.

:func:`tune` fixes the thresholds instead (``M_MMAP_THRESHOLD`` 32 MiB, glibc's largest
dynamic value; ``M_TRIM_THRESHOLD`` 256 MiB, so freed heap memory is kept for the next
step rather than returned and faulted in again): the behaviour a long-running process
reaches anyway, from the first step and whatever it freed before. ``FASTFT_MALLOC_TUNE=0``
leaves glibc's defaults. Nothing happens without glibc (musl, macOS) or for memory that
another allocator (jemalloc, tcmalloc through ``LD_PRELOAD``) or the CUDA caching
allocator manages.

:func:`prefault` touches heap memory ahead of time and frees it, so that the next
allocations (up to that size) reuse pages the kernel has already mapped: what a warm
spare does while it waits, so that the worker it becomes does not fault in its model,
its gradients and the state it heals on the recovery path (~15 ms for the 50.8 MB heal
of the 4.2M model with Adam here).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["tune", "prefault", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "PREFAULT_MAX"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_done: bool | None = None


def tune(env: dict[str, str] | None = None) -> bool:
    """Fix glibc's malloc thresholds for this process (once); True if they were set."""
    global _done
    if _done is not None:
        return _done
    env = dict(os.environ) if env is None else env
    flag = env.get("FASTFT_MALLOC_TUNE", "1").strip().lower()
    if flag in ("0", "false", "no"):
        _done = False
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        _done = False
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        _done = False
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        log.warning("mallopt refused the thresholds; glibc's defaults stay")
    _done = ok
    return ok


_CHUNK = 16 << 20  # under MMAP_THRESHOLD: served from the heap, not mapped
PREFAULT_MAX = TRIM_THRESHOLD - _CHUNK
"""The most :func:`prefault` touches: above the trim threshold, freeing it would return it."""


def prefault(nbytes: int) -> int:
    """Touch ``nbytes`` of heap memory and free it again, keeping it mapped (the trim
    threshold of :func:`tune` must be above it, so only after a successful ``tune()``).
    Returns the bytes prefaulted: 0 when the thresholds are not fixed or ``nbytes`` is 0;
    at most ``PREFAULT_MAX``."""
    if nbytes <= 0 or not tune():
        return 0
    nbytes = min(nbytes, PREFAULT_MAX)
    chunks = [bytearray(_CHUNK) for _ in range(-(-nbytes // _CHUNK))]  # zero-filled: touched
    done = len(chunks) * _CHUNK
    while chunks:  # freed last-first: they merge back into the heap's top, kept mapped
        chunks.pop()
    return done
