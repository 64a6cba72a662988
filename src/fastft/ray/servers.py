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
from pathlib import Path
from typing import Any

from fastft.bus.natscluster import server_binary, write_config
from fastft.launch.children import die_with_parent

__all__ = ["NatsServer", "node_ports"]


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
