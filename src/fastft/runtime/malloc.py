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
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["tune", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

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
