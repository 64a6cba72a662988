"""Prefaulted heap memory stays mapped for the next allocations (a child process)."""

from __future__ import annotations

import os
import platform
import sys

import pytest

PREFAULT_CHILD = r"""
import sys
from fastft.process import malloc

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

before = rss_mb()
done = malloc.prefault(int(sys.argv[1]) << 20)
print(done >> 20, round(rss_mb() - before))
"""


@pytest.mark.skipif(
    not (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"), reason="glibc"
)
def test_prefaulted_memory_stays_mapped_for_the_next_allocations():
    """A warm spare touches heap memory and frees it: it must stay mapped (under the trim
    threshold that tune() sets), or the worker faults it in again on the recovery path."""
    import subprocess

    def run(mb: str, **env: str) -> tuple[int, int]:
        out = subprocess.run(
            [sys.executable, "-c", PREFAULT_CHILD, mb],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
            check=True,
        ).stdout.split()
        return int(out[0]), int(out[1])

    done, grew = run("96")
    assert done == 96 and grew >= 90, (done, grew)  # freed, yet still resident
    assert run("96", FASTFT_MALLOC_TUNE="0")[0] == 0  # the thresholds decide, not the call
    assert run("0")[0] == 0
