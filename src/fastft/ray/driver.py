"""``fastft ray run``: a fastft job on a Ray cluster.

- A placement group of ``nodes`` bundles (the agent and its workers' CPUs, and GPUs),
  spread over the cluster's nodes; a cluster that cannot place them fails at start with
  one line.
- One :class:`~fastft.ray.agent.NodeAgent` actor per bundle, running ``fastft run
  --nnodes N --node-rank i`` for its node: deaths and hangs of workers are the agent's to
  see, as on a node started by hand. The control plane: NATS server actors of the job
  (:mod:`fastft.ray.servers`, by default), node 0's TCPStore (its address probed on bundle
  0 first), or the user's NATS cluster; every node reads one job secret, drawn here.
- Ray's own fault settings, on purpose: the actors restart (``max_restarts``, on another
  node if theirs is gone, which the placement group reschedules) and no task is retried
  (``max_task_retries=0``: the driver's polls are reads). An agent actor's death is a lost
  node: the survivors learn it from its lease, as they would without Ray, and the
  restarted actor's agent is that node started again: its workers join and heal.
- The driver prints every agent's output (the usual ``[rank R.L]:`` prefixes), returns
  the job's exit status (0 when every agent ended 0; else the first failure's), copies
  the events of nodes on other machines into the run directory, and removes what it
  created: actors, placement group.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from fastft.errors import RayJobError
from fastft.process.events import EVENTS_FILE
from fastft.protocol.auth import JobSecret
from fastft.ray.agent import NodeAgent, file_identity
from fastft.ray.servers import ServerWatch, node_ports, start_nats

__all__ = ["RayJobError", "gather_events", "run"]

PLACE_TIMEOUT_S = 60.0
"""How long the placement group may stay pending before the job fails at start."""
POLL_S = 0.1
GONE_AFTER_S = 120.0
"""An agent actor that has not answered for this long is counted as failed."""


def _with_nproc(argv: list[str], nproc: int) -> list[str]:
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


def _reachable(address: str) -> None:
    """Fail at once when nothing listens at ``address`` (HOST:PORT of the head's GCS):
    Ray itself retries such an address for minutes."""
    if address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise RayJobError(f"--address {address!r}: use HOST:PORT of the Ray head (its GCS)")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as e:
        raise RayJobError(f"no Ray cluster at {address}: {e}") from None


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayJobError(
            f"fastft ray run needs Ray: pip install -c constraints.txt 'fastft[ray]' ({e})"
        ) from None
    return ray


def run(
    argv: list[str],
    *,
    nodes: int,
    nproc: int = 1,
    address: str | None = None,
    run_dir: str | None = None,
    job: str | None = None,
    cpus_per_node: float | None = None,
    gpus_per_node: float = 0.0,
    max_node_restarts: int = 3,
    control: str | None = None,
    nats_servers: int = 3,
    out: Any = None,
) -> int:
    """Run ``fastft run ARGV`` (its flags and the script, without the node flags) on
    ``nodes`` agents of the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else the
    running cluster Ray finds on this machine); the job's exit status. The control plane:
    ``control`` (a NATS cluster's URLs of the user's own), else ``nats_servers`` NATS
    servers as actors of the job (one on a single node), else (0) node 0's TCPStore.
    From Python: ``run(["train.py", "--lr", "3e-4"], nodes=2, nproc=4)``; ``nproc`` is
    each node's ``--nproc`` unless ARGV gives it (then they must agree); ``run_dir`` and
    ``job`` default as ``fastft ray run``'s do."""
    out = out or sys.stdout
    if nats_servers < 0 or nats_servers == 2:
        raise RayJobError(
            f"--nats-servers {nats_servers}: use 3 (or more) to survive a server's loss, 1 "
            "for one server, 0 for node 0's TCPStore"
        )
    argv = _with_nproc(argv, nproc)
    if run_dir is None:
        from fastft.process.rundir import default_run_dir

        run_dir = str(default_run_dir("ray"))
    job = job or f"ray-{secrets.token_hex(3)}"
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address.rpartition(":")[0] in ("127.0.0.1", "localhost"):
        # A cluster on loopback (this machine's): Ray would replace 127.0.0.1 with the
        # address of the default route, where no cluster listens; this variable (despite
        # its name) keeps its single-machine addressing. Before Ray's import reads it.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cpus = float(cpus_per_node if cpus_per_node is not None else nproc + 1)
    _reachable(address)
    try:
        ray.init(
            address=address,
            log_to_driver=False,
            logging_level="ERROR",
            include_dashboard=False,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayJobError(f"no Ray cluster at {address}: {e}") from None
    pg = None
    actors: list[Any] = []
    servers: list[Any] = []
    try:
        have = ray.cluster_resources()
        need = {"CPU": cpus * nodes, "GPU": gpus_per_node * nodes}
        short = {k: v for k, v in need.items() if v > have.get(k, 0.0)}
        if short:
            raise RayJobError(
                f"the cluster has {', '.join(f'{have.get(k, 0):g} {k}' for k in short)}; "
                f"{nodes} nodes of {cpus:g} CPU and {gpus_per_node:g} GPU need "
                f"{', '.join(f'{v:g} {k}' for k, v in short.items())} (lower --nodes, --nproc, "
                "--cpus-per-node, or add nodes)"
            )
        bundle = {"CPU": cpus, **({"GPU": gpus_per_node} if gpus_per_node else {})}
        pg = placement_group([dict(bundle) for _ in range(nodes)], strategy="SPREAD")
        try:
            ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RayJobError(
                f"Ray could not place {nodes} bundles of {bundle} within {PLACE_TIMEOUT_S:g} s "
                "(the resources exist in sum but no node has a bundle's worth free)"
            ) from None

        def on(i: int) -> Any:
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

        if control:  # (a NATS cluster of the user's own)
            plane, where = ["--control", control], control
        elif nats_servers:
            urls = start_nats(
                ray,
                cls_on=on,
                nodes=nodes,
                servers=nats_servers,
                run_dir=run_dir,
                restarts=max_node_restarts,
                into=servers,
            )
            plane = ["--control", ",".join(urls)]
            where = f"NATS, {len(urls)} server actors on {min(nodes, len(urls))} nodes"
        else:  # (node 0's agent hosts the TCPStore: its address, from bundle 0)
            first = ray.get(
                ray.remote(node_ports).options(num_cpus=0, scheduling_strategy=on(0)).remote(1),
                timeout=60,
            )
            address_ = f"{first['ip']}:{first['ports'][0]}"
            plane, where = ["--store", address_], f"{address_} (node 0's TCPStore)"
        secret_path = str(Path(run_dir) / "job.secret")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        JobSecret.draw().save(secret_path)  # (the driver's copy: fastft inject, report)
        blob = Path(secret_path).read_bytes()  # (each actor writes it on its node)
        cls = ray.remote(NodeAgent)
        for i in range(nodes):
            node_argv = [
                *("--nnodes", str(nodes), "--node-rank", str(i), *plane),
                *("--job-secret-file", secret_path, "--run-dir", run_dir, "--job", job),
                *argv,
            ]
            actors.append(
                cls.options(
                    num_cpus=cpus,
                    num_gpus=gpus_per_node,
                    max_restarts=max_node_restarts,
                    max_task_retries=0,
                    scheduling_strategy=on(i),
                    name=f"fastft-{job}-node{i}",
                ).remote(i, node_argv, blob, secret_path, run_dir)
            )
        print(
            f"fastft ray: job {job!r}, {nodes} node agents x {nproc} workers on the Ray "
            f"cluster, control plane {where}, run dir {run_dir}",
            file=out,
            flush=True,
        )
        status = _follow(ray, actors, servers, out)
        gather_events(ray, actors, Path(run_dir), out)
        return status
    finally:
        for a in [*actors, *servers]:
            try:
                ray.get(a.stop.remote(), timeout=60)
            except Exception:  # (dead, restarting, or out of restarts)
                pass
            ray.kill(a, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()


def _follow(ray: Any, actors: list[Any], servers: list[Any], out: Any) -> int:
    """Print the agents' output until every agent ended, and say when a NATS server
    actor dies and comes back; the job's exit status."""
    watch = ServerWatch(ray, servers, out)
    offsets = [0] * len(actors)
    lives: list[int | None] = [None] * len(actors)
    status: list[int | None] = [None] * len(actors)
    since: list[float | None] = [None] * len(actors)
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(s is None for s in status):
            if stop["signal"]:
                for a in actors:
                    a.stop.remote()
                stop["signal"] = 0
            for i, a in enumerate(actors):
                if status[i] is not None:
                    continue
                try:
                    got = ray.get(a.poll.remote(offsets[i]), timeout=10)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    # (dying, restarting, or out of restarts: Ray's errors do not say which)
                    first_miss = since[i] = since[i] or time.monotonic()
                    if time.monotonic() - first_miss > GONE_AFTER_S:
                        print(
                            f"fastft ray: node {i}'s agent actor has not answered for "
                            f"{GONE_AFTER_S:g} s (out of restarts, or no node to run on): "
                            "counted as failed",
                            file=out,
                        )
                        status[i] = 1
                    continue
                since[i] = None
                if got["pid"] != lives[i]:
                    if lives[i] is not None:
                        print(
                            f"fastft ray: node {i}'s agent actor died; Ray started it again "
                            f"(pid {got['pid']}): its workers join and heal",
                            file=out,
                            flush=True,
                        )
                        offsets[i] = 0
                        got = ray.get(a.poll.remote(0), timeout=10)
                    lives[i] = got["pid"]
                for line in got["lines"]:
                    print(line, file=out)
                offsets[i] += len(got["lines"])
                status[i] = got["rc"]
            watch.round()
            out.flush()
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return next((s for s in status if s), 0) or 0


def gather_events(ray: Any, actors: list[Any], run_dir: Path, out: Any) -> None:
    """Copy each node's events file that is not the driver's own (another machine's, not
    on a shared filesystem) to ``RUN_DIR/node<i>/events.jsonl``: ``fastft report
    RUN_DIR/node<i>`` reads it (each machine's monotonic clock orders its own file)."""
    mine = run_dir / EVENTS_FILE
    here = file_identity(mine) if mine.exists() else None
    for i, a in enumerate(actors):
        dest = run_dir / f"node{i}" / EVENTS_FILE
        offset = 0
        try:
            while True:
                got = ray.get(a.events.remote(offset), timeout=60)
                if got["where"] is None or tuple(got["where"]) == here:
                    break  # (no file, or the driver's own)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with open(dest, "wb" if offset == 0 else "ab") as f:
                    f.write(got["data"])
                offset += len(got["data"])
                if not got["data"] or offset >= got["size"]:
                    print(f"fastft ray: node {i}'s events: {dest}", file=out)
                    break
        except Exception as e:  # (an agent actor out of restarts: its events are lost)
            print(f"fastft ray: node {i}'s events could not be read: {e}", file=out)
