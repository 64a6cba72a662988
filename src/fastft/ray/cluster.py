"""The Ray driver's dealings with the cluster (:func:`fastft.ray.driver.run`): connect,
place the job's node agents, start or name its control plane, draw its secret, and stop
everything at the end."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastft.errors import RayJobError
from fastft.protocol.auth import JobSecret
from fastft.ray import plan as decide
from fastft.ray.servers import node_ports, start_nats

__all__ = ["PLACE_TIMEOUT_S", "connect", "control_plane", "draw_secret", "place", "stop_all"]

PLACE_TIMEOUT_S = 60.0
"""How long the placement group may stay pending before the job fails at start."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayJobError(
            f"fastft ray run needs Ray: pip install -c constraints.txt 'fastft[ray]' ({e})"
        ) from None
    return ray


def connect(address: str | None, runtime_env: dict[str, Any] | None) -> tuple[Any, bool]:
    """Ray, connected to the cluster at ``address`` (None: ``RAY_ADDRESS``, else the one Ray
    finds on this machine) unless this driver connected already; whether it is this
    call's connection (then shut down at the end)."""
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if decide.loopback(address):
        # A cluster on loopback (this machine's): Ray would replace 127.0.0.1 with the
        # address of the default route, where no cluster listens; this variable (despite
        # its name) keeps its single-machine addressing. Before Ray's import reads it.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = _ray()

    ours = not ray.is_initialized()  # (a driver that called ray.init() keeps its own)
    if ours:
        decide.reachable(address)
        try:
            ray.init(
                address=address,
                log_to_driver=False,
                logging_level="ERROR",
                include_dashboard=False,
                configure_logging=False,
                # (the job's: Ray uploads a local working_dir at ray.init, not per actor)
                runtime_env=runtime_env,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayJobError(f"no Ray cluster at {address}: {e}") from None
    return ray, ours


def place(
    ray: Any,
    *,
    nodes: int,
    nproc: int,
    cpus_per_node: float | None,
    gpus_per_node: float,
    placement: str,
) -> tuple[Any, Any]:
    """The job's placement group, one bundle per node agent, placed (or RayJobError: what
    could not be placed); and the bundles' plan."""
    from ray.util.placement_group import placement_group

    bundles = decide.plan_bundles(
        nodes=nodes,
        nproc=nproc,
        cpus_per_node=cpus_per_node,
        gpus_per_node=gpus_per_node,
        placement=placement,
        have=ray.cluster_resources(),
        machines=sum(1 for n in ray.nodes() if n.get("Alive")),
    )
    pg = placement_group(
        [dict(bundles.bundle) for _ in range(bundles.count)], strategy=bundles.strategy
    )
    try:
        ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RayJobError(bundles.unplaced(PLACE_TIMEOUT_S)) from None
    return pg, bundles


def control_plane(
    ray: Any,
    on: Any,
    *,
    control: str | None,
    nodes: int,
    nats_servers: int,
    run_dir: str,
    restarts: int,
    servers: list[Any],
) -> tuple[list[str], str]:
    """The control plane's flags for every node's agent, and a line that says where it is:
    the user's NATS cluster, NATS server actors (added to ``servers``), or node 0's
    TCPStore (its address, from bundle 0: ``on(i)`` places a task on bundle ``i``)."""
    if control:  # (a NATS cluster of the user's own)
        plane, where = ["--control", control], control
    elif nats_servers:
        urls = start_nats(
            ray,
            cls_on=on,
            nodes=nodes,
            servers=nats_servers,
            run_dir=run_dir,
            restarts=restarts,
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
    return plane, where


def draw_secret(run_dir: str) -> tuple[str, bytes]:
    """The job's secret, drawn and saved in the run directory; its path and its bytes
    (each actor writes it on its node)."""
    secret_path = str(Path(run_dir) / "job.secret")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    Path(secret_path).unlink(missing_ok=True)  # (a run resumed in its directory: its
    # last job's secret, over; each job draws its own)
    JobSecret.draw().save(secret_path)  # (the driver's copy: fastft inject, report)
    blob = Path(secret_path).read_bytes()  # (each actor writes it on its node)
    return secret_path, blob


def stop_all(ray: Any, actors: list[Any], pg: Any, *, shutdown: bool) -> None:
    """Stop the job's ``actors`` (each asked, then killed), free its placement group and,
    with ``shutdown``, disconnect from Ray."""
    for a in actors:
        try:
            ray.get(a.stop.remote(), timeout=60)
        except Exception:  # (dead, restarting, or out of restarts)
            pass
        ray.kill(a, no_restart=True)
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
    if shutdown:
        ray.shutdown()
