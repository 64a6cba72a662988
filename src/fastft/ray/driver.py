"""``fastft ray run``: a fastft job on a Ray cluster.

- A placement group of ``nodes`` bundles (the agent and its workers' CPUs, and GPUs),
  each on a machine of its own (``STRICT_SPREAD``; ``placement="spread"`` lets two share
  one); a cluster that cannot place them fails at start with one line. The decisions are
  :mod:`fastft.ray.plan`'s; this module acts on them.
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
import sys
import time
from pathlib import Path
from typing import Any

from fastft.errors import RayJobError
from fastft.process.events import EVENTS_FILE
from fastft.protocol.auth import JobSecret
from fastft.ray import plan as decide
from fastft.ray.agent import NodeAgent, file_identity
from fastft.ray.servers import ServerWatch, node_ports, start_nats

__all__ = ["RayJobError", "gather_events", "run"]

PLACE_TIMEOUT_S = 60.0
"""How long the placement group may stay pending before the job fails at start."""
POLL_S = 0.1


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
    placement: str = "strict",
    runtime_env: dict[str, Any] | None = None,
    files: dict[str, bytes] | None = None,
    out: Any = None,
) -> int:
    """Run ``fastft run ARGV`` (its flags and the script, without the node flags) on
    ``nodes`` agents of the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else the
    running cluster Ray finds on this machine); the job's exit status. The control plane:
    ``control`` (a NATS cluster's URLs of the user's own), else ``nats_servers`` NATS
    servers as actors of the job (one on a single node), else (0) node 0's TCPStore.
    From Python: ``run(["train.py", "--lr", "3e-4"], nodes=2, nproc=4)``; ``nproc`` is
    each node's ``--nproc`` unless ARGV gives it (then they must agree); ``run_dir`` and
    ``job`` default as ``fastft ray run``'s do. ``placement``: ``strict`` (each node on a
    machine of its own) or ``spread``. ``runtime_env``: Ray's, for the node agent actors
    and so their workers (``{"working_dir": ".", "pip": [...]}``: the script's path is
    then relative to the working directory Ray ships to every node). ``files``: path ->
    bytes, written on every node before its agent starts."""
    out = out or sys.stdout
    decide.check_nats_servers(nats_servers)
    argv = decide.with_nproc(argv, nproc)
    if run_dir is None:
        from fastft.process.rundir import default_run_dir

        run_dir = str(default_run_dir("ray"))
    run_dir = os.path.abspath(run_dir)  # (an actor's working directory may be Ray's)
    job = job or f"ray-{secrets.token_hex(3)}"
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if decide.loopback(address):
        # A cluster on loopback (this machine's): Ray would replace 127.0.0.1 with the
        # address of the default route, where no cluster listens; this variable (despite
        # its name) keeps its single-machine addressing. Before Ray's import reads it.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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
    pg = None
    actors: list[Any] = []
    servers: list[Any] = []
    try:
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
            node_argv = decide.node_argv(
                i,
                nodes=nodes,
                plane=plane,
                secret_path=secret_path,
                run_dir=run_dir,
                job=job,
                argv=argv,
            )
            actors.append(
                cls.options(
                    num_cpus=bundles.bundle["CPU"],
                    num_gpus=gpus_per_node,
                    max_restarts=max_node_restarts,
                    max_task_retries=0,
                    scheduling_strategy=on(i),
                    name=f"fastft-{job}-node{i}",
                ).remote(i, node_argv, blob, secret_path, run_dir, files)
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
    actor dies and comes back; the job's exit status (:mod:`fastft.ray.plan` decides what
    each poll, or its absence, means)."""
    watch = ServerWatch(ray, servers, out)
    tracks = [decide.AgentTrack(i) for i in range(len(actors))]
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(t.status is None for t in tracks):
            if stop["signal"]:
                for a in actors:
                    a.stop.remote()
                stop["signal"] = 0
            for a, track in zip(actors, tracks, strict=True):
                if track.status is not None:
                    continue
                try:
                    got = ray.get(a.poll.remote(track.offset), timeout=10)
                    if track.polled(got):  # (a new life: its output from the start)
                        got = ray.get(a.poll.remote(0), timeout=10)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    track.silent(time.monotonic())
                else:
                    for line in track.printed(got):
                        print(line, file=out)
                for note in track.notes:
                    print(note, file=out, flush=True)
                track.notes.clear()
            watch.round()
            out.flush()
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return decide.job_status([t.status for t in tracks])


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
