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
- A lost node's return: beside each agent actor a standby (``num_cpus=0``, the same
  bundle) runs ``fastft run --standby``: its zygote warm, waiting. An agent actor's death
  (Ray's ``ActorDiedError``; ``max_restarts=0``, so Ray never starts a second agent for
  the node) is a lost node: the driver tells the standby to go, and it takes the node
  over at once (the dead agent's workers declared dead, its own forked from the warm
  zygote, joining and healing), and a new standby is made. Without a standby (its machine
  gone too, ``standby=False``, or node 0 on a TCPStore) a new agent actor takes it over,
  where Ray places the node's bundle. No task is retried (``max_task_retries=0``: the
  driver's polls are reads).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastft.errors import RayJobError
from fastft.process.events import EVENTS_FILE
from fastft.ray import plan as decide
from fastft.ray.agent import NodeAgent, file_identity
from fastft.ray.cluster import connect, control_plane, draw_secret, place, stop_all
from fastft.ray.servers import ServerWatch

__all__ = ["RayJobError", "gather_events", "run"]

POLL_S = 0.1


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
    standby: bool = True,
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
    bytes, written on every node before its agent starts. ``standby``: keep a warm
    standby agent per node (a lost node back in a fraction of a second; node 0 only with
    a NATS control plane); ``max_node_restarts``: how many times a node's agent may be
    replaced."""
    out = out or sys.stdout
    decide.check_nats_servers(nats_servers)
    argv = decide.with_nproc(argv, nproc)
    run_dir = _run_dir(run_dir)
    job = job or f"ray-{secrets.token_hex(3)}"
    ray, ours = connect(address, runtime_env)

    pg = None
    created: list[Any] = []  # (every agent actor and standby: all stopped at the end)
    servers: list[Any] = []
    try:
        pg, bundles = place(
            ray,
            nodes=nodes,
            nproc=nproc,
            cpus_per_node=cpus_per_node,
            gpus_per_node=gpus_per_node,
            placement=placement,
        )
        agents, where = _start(
            ray,
            pg,
            bundles,
            created,
            servers,
            nodes=nodes,
            job=job,
            argv=argv,
            run_dir=run_dir,
            control=control,
            nats_servers=nats_servers,
            restarts=max_node_restarts,
            gpus_per_node=gpus_per_node,
            standby=standby,
            files=files,
            actor_env={} if ours or not runtime_env else {"runtime_env": runtime_env},
        )
        print(f"fastft ray: job {job!r}, {nodes} node agents x {nproc} workers on the Ray "
              f"cluster, control plane {where}, run dir {run_dir}", file=out, flush=True)  # fmt: skip
        tracks = [decide.AgentTrack(i, max_node_restarts) for i in range(nodes)]
        status = _follow(ray, agents, tracks, servers, out)
        gather_events(ray, agents.actors, Path(run_dir), out)
        return status
    finally:
        stop_all(ray, [*created, *servers], pg, shutdown=ours)


def _run_dir(run_dir: str | None) -> str:
    """The job's run directory as an absolute path (an actor's working directory may be
    Ray's): ``run_dir``, else a new one as ``fastft ray run``'s default."""
    if run_dir is None:
        from fastft.process.rundir import default_run_dir

        run_dir = str(default_run_dir("ray"))
    return os.path.abspath(run_dir)


def _start(
    ray: Any,
    pg: Any,
    bundles: Any,
    created: list[Any],
    servers: list[Any],
    *,
    nodes: int,
    job: str,
    argv: list[str],
    run_dir: str,
    control: str | None,
    nats_servers: int,
    restarts: int,
    gpus_per_node: float,
    standby: bool,
    files: dict[str, bytes] | None,
    actor_env: dict[str, Any],
) -> tuple[_Nodes, str]:
    """:func:`run`'s start: the control plane (its servers into ``servers``), the job
    secret, every node's agent actor and its standby (each into ``created``); the agents
    and where the control plane is."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def on(i: int) -> Any:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

    plane, where = control_plane(
        ray,
        on,
        control=control,
        nodes=nodes,
        nats_servers=nats_servers,
        run_dir=run_dir,
        restarts=restarts,
        servers=servers,
    )
    secret_path, blob = draw_secret(run_dir)
    cls = ray.remote(NodeAgent)
    argvs = [
        decide.node_argv(
            i,
            nodes=nodes,
            plane=plane,
            secret_path=secret_path,
            run_dir=run_dir,
            job=job,
            argv=argv,
        )
        for i in range(nodes)
    ]

    def make(i: int, *, holds: bool = True, warm: bool = False) -> Any:
        """Node ``i``'s agent actor (``holds``: its bundle's CPUs and GPUs) or a
        standby (``warm``: ``fastft run --standby``, waiting for ``go``), named for
        Ray's dashboard (``fastft-JOB-node1``, its standbys ``-node1-standby-2``...,
        a new agent actor ``-node1-5``)."""
        n = len(created)
        suffix = (f"-{n}" if warm else "") if holds else f"-standby-{n}"
        name = f"fastft-{job}-node{i}{suffix}"
        a = cls.options(
            num_cpus=bundles.bundle["CPU"] if holds else 0,
            num_gpus=gpus_per_node if holds else 0,
            max_restarts=0,  # (the driver replaces a dead agent: two never serve a node)
            max_task_retries=0,
            scheduling_strategy=on(i),
            name=name,
            **actor_env,
        ).remote(i, argvs[i], blob, secret_path, run_dir, files, warm)
        created.append(a)
        return a

    actors = [make(i) for i in range(nodes)]
    # (node 0 hosts a TCPStore: its loss ends the job, and it has no standby)
    keep = [standby and (i > 0 or plane[0] == "--control") for i in range(nodes)]
    standbys = [make(i, holds=False, warm=True) if keep[i] else None for i in range(nodes)]
    return _Nodes(ray, actors, standbys, make, keep), where


class _Nodes:
    """The job's node agent actors, one per node, and their standbys: what the driver
    does when :meth:`fastft.ray.plan.AgentTrack.died` says how to replace one."""

    def __init__(
        self,
        ray: Any,
        actors: list[Any],
        standbys: list[Any],
        make: Callable[..., Any],
        keep: list[bool],
    ) -> None:
        self.ray, self.make, self.keep = ray, make, keep
        self.actors, self.standbys = actors, standbys
        self.ready = [False] * len(actors)
        """Whether each node's standby said it is warm."""
        self.asked: list[Any] = [None] * len(actors)
        """Each standby's poll in flight (a standby still being placed answers late)."""
        self.gpus: list[str | None] = [None] * len(actors)
        """Each node's ``CUDA_VISIBLE_DEVICES`` as its agent actor last said (a standby
        holds no GPU of Ray's: it is handed its node's)."""

    def replace(self, i: int, how: str) -> None:
        """Node ``i``'s agent actor died: its standby takes the node over (``standby``) or
        a new agent actor does (``new``; also when the standby does not answer: its
        machine is gone); a new standby is made for the next time."""
        ray, standby = self.ray, self.standbys[i]
        told = False
        if how == "standby" and standby is not None:
            env = {"CUDA_VISIBLE_DEVICES": self.gpus[i]} if self.gpus[i] is not None else {}
            try:
                told = ray.get(standby.go.remote(env), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                told = False
        if told:
            self.actors[i] = standby
        else:  # (a standby told at once: it takes the node over as soon as it is warm)
            if standby is not None:  # (never two agents for one node: it may have heard)
                ray.kill(standby, no_restart=True)
            self.actors[i] = self.make(i, warm=True)
            self.actors[i].go.remote({})
        self.standbys[i] = self.make(i, holds=False, warm=True) if self.keep[i] else None
        self.ready[i], self.asked[i] = False, None

    def watch_standby(self, i: int) -> str | None:
        """Node ``i``'s standby, until it said it is warm: a line to print when it did,
        or when it ended before it was needed (the node has none from then on)."""
        ray, standby = self.ray, self.standbys[i]
        if standby is None or self.ready[i]:
            return None
        if self.asked[i] is None:
            self.asked[i] = standby.poll.remote(0)
        if not ray.wait([self.asked[i]], timeout=0)[0]:
            return None  # (not answered yet: never block the driver's loop)
        try:
            got = ray.get(self.asked[i])
        except ray.exceptions.RayActorError as e:
            got = {"lines": [], "rc": f"its actor died: {type(e).__name__}"}
        self.asked[i] = None
        if got["rc"] is not None:
            self.standbys[i] = None
            last = got["lines"][-1] if got["lines"] else ""
            return f"fastft ray: node {i}'s standby agent ended ({got['rc']}); none for it: {last}"
        if got["lines"]:
            self.ready[i] = True
            return f"fastft ray: node {i}'s standby agent is warm"
        return None


def _follow(
    ray: Any, nodes: _Nodes, tracks: list[decide.AgentTrack], servers: list[Any], out: Any
) -> int:
    """Print the agents' output until every agent ended, replace the agent actors that
    die, and say when a NATS server actor dies and comes back; the job's exit status
    (:mod:`fastft.ray.plan` decides what each poll, or its absence, means)."""
    watch = ServerWatch(ray, servers, out)
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(t.status is None for t in tracks):
            if stop["signal"]:
                for a in nodes.actors:
                    a.stop.remote()
                stop["signal"] = 0
            for i, track in enumerate(tracks):
                a = nodes.actors[i]
                if track.status is not None:
                    continue
                try:
                    got = ray.get(a.poll.remote(track.offset), timeout=10)
                    if track.polled(got):  # (a new life: its output from the start)
                        got = ray.get(a.poll.remote(0), timeout=10)
                except ray.exceptions.ActorDiedError:
                    how = track.died(nodes.standbys[i] is not None)
                    if how != "failed":
                        nodes.replace(i, how)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    track.silent(time.monotonic())
                else:
                    nodes.gpus[i] = got.get("gpus")
                    for line in track.printed(got):
                        print(line, file=out)
                for note in track.notes:
                    print(note, file=out, flush=True)
                track.notes.clear()
                if track.status is None and (said := nodes.watch_standby(i)):
                    print(said, file=out, flush=True)
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
