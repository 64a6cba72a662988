"""The Ray tier (``make test-ray``, which installs the ``ray`` extra first): ``fastft ray
run`` on a real local Ray cluster of two nodes (a head and a second raylet on 127.0.0.1,
each with its own CPUs and a small object store), started for the module and stopped
after it. Not collected by ``make test``; here a missing Ray fails, it is not skipped."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "fault"))  # (the fault tier's checks)

# Ray names a machine by its default route's address, even for a cluster it starts on
# 127.0.0.1; this variable (despite its name) keeps every Ray process on loopback. Set
# before Ray is imported, here and in the processes the tests start.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

CPUS_PER_NODE = 3
"""Each simulated node's CPUs: one agent and 2 workers (the bundle: nproc + 1)."""


def _ours() -> list[psutil.Process]:
    """This job's processes: agents, workers, zygotes, spares (not Ray's own pool)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "fastft" in line and "ray" not in line.split()[0]:
            out.append(p)
    return out


@pytest.fixture(autouse=True)
def no_leftovers():
    """Replaces the suite's check: Ray keeps idle workers of its own between tests (they
    end with the cluster, checked at the module's end); no agent, worker or zygote of a
    job may outlive its test."""
    yield
    deadline = time.monotonic() + 10.0
    while _ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _ours()
    for p in left:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"left behind: {[' '.join(p.cmdline())[:120] for p in left]}"


@pytest.fixture(scope="session")
def cluster():
    """Two Ray nodes on this machine (the head and a second raylet), one for the whole
    tier; their address."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": CPUS_PER_NODE, "object_store_memory": 80 << 20}
    # (the head's dashboard: `ray job submit`'s server; at Ray's default port, or another
    # free one Ray picks if that is taken: a port chosen here could be taken by one of
    # Ray's own processes before the dashboard binds it)
    head = {**node, "include_dashboard": True}
    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        c.add_node(**node)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()
    me = psutil.Process()
    deadline = time.monotonic() + 20
    while me.children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = me.children(recursive=True)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"the Ray cluster left {[p.name() for p in left]}"
