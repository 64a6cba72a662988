"""What ``fastft ray run`` decides, apart from Ray (pure: no Ray import, unit-tested without
a cluster): the node agents' command lines, the placement group's bundles and strategy,
whether the cluster can hold them, and what each agent actor's poll (or its silence)
means for the job. :mod:`fastft.ray.driver` acts on these decisions.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastft.errors import RayJobError

__all__ = [
    "GONE_AFTER_S",
    "PLACEMENTS",
    "AgentTrack",
    "BundlePlan",
    "job_status",
    "loopback",
    "node_argv",
    "plan_bundles",
    "reachable",
    "with_nproc",
]

GONE_AFTER_S = 120.0
"""An agent actor that has not answered for this long is counted as failed."""

PLACEMENTS = {"strict": "STRICT_SPREAD", "spread": "SPREAD"}
"""``--placement``: ``strict`` (the default) puts every job node on a machine of its own,
so that one machine's loss is one node's; ``spread`` lets Ray put two on one machine when
it must (a cluster with fewer machines than job nodes: tests, a laptop)."""


def with_nproc(argv: list[str], nproc: int) -> list[str]:
    """ARGV with ``--nproc`` (the workers per node): given among the flags before the
    script (``-m MODULE``, ``--``, or a ``.py`` path), it must be ``nproc``."""
    for i, a in enumerate(argv):
        if a in ("--", "-m") or a.endswith(".py"):
            break  # (the script and its own arguments)
        given = a.partition("=")[2] if a.startswith("--nproc=") else None
        if a == "--nproc" and i + 1 < len(argv):
            given = argv[i + 1]
        if given is not None:
            if given != str(nproc):
                raise RayJobError(f"--nproc {given} in argv, but nproc={nproc}: give one")
            return argv
    return ["--nproc", str(nproc), *argv]


def loopback(address: str) -> bool:
    """Whether ``address`` (HOST:PORT) is a cluster on this machine's loopback."""
    return address.rpartition(":")[0] in ("127.0.0.1", "localhost")


def reachable(address: str) -> None:
    """Fail at once when nothing listens at ``address`` (HOST:PORT of the head's GCS):
    Ray itself retries such an address for minutes. ``auto``, ``local`` and URLs
    (``ray://``) are Ray's to resolve."""
    if address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise RayJobError(f"--address {address!r}: use HOST:PORT of the Ray head (its GCS)")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as e:
        raise RayJobError(f"no Ray cluster at {address}: {e}") from None


def check_nats_servers(n: int) -> None:
    if n < 0 or n == 2:
        raise RayJobError(
            f"--nats-servers {n}: use 3 (or more) to survive a server's loss, 1 for one "
            "server, 0 for node 0's TCPStore"
        )


@dataclass(frozen=True)
class BundlePlan:
    """The placement group: ``count`` bundles of ``bundle`` under ``strategy``."""

    bundle: dict[str, float]
    count: int
    strategy: str

    def unplaced(self, timeout_s: float) -> str:
        """Why the group stayed pending for ``timeout_s``."""
        if self.strategy == "STRICT_SPREAD":
            return (
                f"Ray could not place {self.count} bundles of {self.bundle}, each on a machine "
                f"of its own (--placement strict), within {timeout_s:g} s: some machines "
                "lack a bundle's worth free. Free them, add machines, or --placement spread"
            )
        return (
            f"Ray could not place {self.count} bundles of {self.bundle} within {timeout_s:g} s "
            "(the resources exist in sum but no node has a bundle's worth free)"
        )


def plan_bundles(
    *,
    nodes: int,
    nproc: int,
    cpus_per_node: float | None,
    gpus_per_node: float,
    placement: str,
    have: Mapping[str, float],
    machines: int,
) -> BundlePlan:
    """The bundles for ``nodes`` agents of ``nproc`` workers on a cluster whose resources
    are ``have`` (``ray.cluster_resources()``) over ``machines`` live Ray nodes; a
    :class:`RayJobError` saying what to change when it cannot hold them."""
    if placement not in PLACEMENTS:
        raise RayJobError(f"--placement {placement!r}: one of {', '.join(PLACEMENTS)}")
    cpus = float(cpus_per_node if cpus_per_node is not None else nproc + 1)
    need = {"CPU": cpus * nodes, "GPU": gpus_per_node * nodes}
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0)}
    if short:
        raise RayJobError(
            f"the cluster has {', '.join(f'{have.get(k, 0):g} {k}' for k in short)}; "
            f"{nodes} nodes of {cpus:g} CPU and {gpus_per_node:g} GPU need "
            f"{', '.join(f'{v:g} {k}' for k, v in short.items())} (lower --nodes, --nproc, "
            "--cpus-per-node, or add nodes)"
        )
    if placement == "strict" and machines < nodes:
        raise RayJobError(
            f"the cluster has {machines} machine(s) (Ray nodes) and the job {nodes} nodes: "
            "--placement strict (the default) puts each job node on a machine of its own, so "
            "that one machine's loss is one node's; add machines, or --placement spread to "
            "share them"
        )
    bundle = {"CPU": cpus, **({"GPU": gpus_per_node} if gpus_per_node else {})}
    return BundlePlan(bundle=bundle, count=nodes, strategy=PLACEMENTS[placement])


def node_argv(
    node: int,
    *,
    nodes: int,
    plane: Sequence[str],
    secret_path: str,
    run_dir: str,
    job: str,
    argv: Sequence[str],
) -> list[str]:
    """``fastft run``'s arguments for node ``node``'s agent."""
    return [
        *("--nnodes", str(nodes), "--node-rank", str(node), *plane),
        *("--job-secret-file", secret_path, "--run-dir", run_dir, "--job", job),
        *argv,
    ]


@dataclass
class AgentTrack:
    """What the driver knows of one node's agent actor, and what its polls mean. The
    driver replaces a dead agent actor itself (Ray's ``max_restarts`` is 0 for them, so
    two agents never serve one node): with the node's standby, warm, when one is ready
    (:meth:`died`)."""

    node: int
    max_restarts: int = 3
    """``--max-node-restarts``: how many times the node's agent may be replaced."""
    offset: int = 0
    """Output lines of this life already printed."""
    life: int | None = None
    """The actor process's pid (a new one: a new life, read from its start)."""
    status: int | None = None
    """The agent's exit status, once it ended (or counted as failed)."""
    restarts: int = 0
    silent_since: float | None = None
    notes: list[str] = field(default_factory=list)

    def polled(self, got: Mapping[str, Any]) -> bool:
        """An answer (``NodeAgent.poll``): True when the actor is a new life whose output
        must be read again from its start (the caller polls again from 0)."""
        self.silent_since = None
        if got["pid"] != self.life:
            restarted = self.life is not None
            self.life = got["pid"]
            if restarted:
                self.notes.append(  # (Ray restarted it: not asked of Ray, but said)
                    f"fastft ray: node {self.node}'s agent actor answers from a new process "
                    f"(pid {got['pid']}): its output again from the start"
                )
                self.offset = 0
                return True
        return False

    def died(self, standby: bool) -> str:
        """The agent actor is dead for good (Ray's ``ActorDiedError``); what the driver
        does: ``standby`` (tell the node's standby to take it over: ``standby`` says one
        is there), ``new`` (start a new agent actor: Ray places it where the node's bundle
        is, on another machine if this one is gone) or ``failed`` (out of restarts)."""
        self.silent_since = None
        if self.restarts >= self.max_restarts:
            self.notes.append(
                f"fastft ray: node {self.node}'s agent actor died, after {self.restarts} "
                "restart(s) of the node (--max-node-restarts): counted as failed"
            )
            self.status = 1
            return "failed"
        self.restarts += 1
        self.life, self.offset = None, 0
        how = "its standby agent takes the node over" if standby else "a new agent starts"
        self.notes.append(
            f"fastft ray: node {self.node}'s agent actor died; {how} (restart "
            f"{self.restarts} of {self.max_restarts}): its workers join and heal"
        )
        return "standby" if standby else "new"

    def printed(self, got: Mapping[str, Any]) -> list[str]:
        """The lines of an answer to print; records the exit status once given."""
        self.offset += len(got["lines"])
        self.status = got["rc"]
        return list(got["lines"])

    def silent(self, now: float) -> None:
        """No answer (the actor dying, restarting, or out of restarts: Ray's errors do not
        say which): counted as failed once silent for :data:`GONE_AFTER_S`."""
        first = self.silent_since = self.silent_since or now
        if now - first > GONE_AFTER_S:
            self.notes.append(
                f"fastft ray: node {self.node}'s agent actor has not answered for "
                f"{GONE_AFTER_S:g} s (out of restarts, or no node to run on): counted as failed"
            )
            self.status = 1


def job_status(statuses: Sequence[int | None]) -> int:
    """The job's exit status: 0 when every agent ended 0; else the first failure's."""
    return next((s for s in statuses if s), 0) or 0
