"""Starting torchft's lighthouse for ``fastft run --torchft``: on node 0, in a process of
its own (``fastft``: :class:`~fastft.integrations.torchft.lighthouse.BusLighthouse`, a bus
subscriber) or in the agent (``plain``: torchft's own); other nodes read its address from
the store. The agent calls :func:`start_lighthouse` and :func:`stop_lighthouse`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fastft.integrations.torchft.lighthouse import lighthouse_key

__all__ = ["start_for_agent", "start_lighthouse", "stop_lighthouse"]


def start_lighthouse(
    *,
    kind: str,
    job: str,
    node_rank: int,
    store: dist.Store,
    store_addr: str,
    min_replicas: int,
    world_size: int,
    heartbeat_ms: int,
    join_ms: int,
    run_dir: str,
    secret_file: str,
    loopback: bool,
    wait_s: float,
    preexec: Callable[[], None],
) -> tuple[Any, str]:
    """Returns (the lighthouse: a process, a server or None on other nodes, its address)."""
    key = lighthouse_key(job)
    if node_rank != 0:
        return None, store.get(key).decode()
    local = loopback or store_addr.startswith("127.0.0.1:")
    host = "127.0.0.1" if local else "0.0.0.0"
    adv = "127.0.0.1" if local else socket.gethostname()
    lighthouse: Any
    if kind == "plain":
        os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(
            bind=f"{host}:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_ms,
            heartbeat_timeout_ms=heartbeat_ms,
        )
        port = int(lighthouse.address().rpartition(":")[2])
        store.set(key, f"http://{adv}:{port}")
        return lighthouse, store.get(key).decode()
    lighthouse = subprocess.Popen(
        [
            sys.executable,
            "-c",  # not -m: the package imports the module first (runpy warns)
            "import sys; from fastft.integrations.torchft.lighthouse_main import main; sys.exit(main())",
            f"--store={store_addr}",
            f"--job={job}",
            f"--bind={host}:0",
            f"--advertise={adv}",
            f"--min-replicas={min_replicas}",
            f"--heartbeat-ms={heartbeat_ms}",
            f"--join-ms={join_ms}",
            # the first quorum waits for every replica started (slow imports vary)
            f"--first-quorum={world_size}",
            f"--run-dir={run_dir}",
            f"--secret-file={secret_file}",
        ],
        preexec_fn=preexec,
    )
    deadline = time.monotonic() + wait_s
    while not store.check([key]):
        if lighthouse.poll() is not None or time.monotonic() > deadline:
            stop_lighthouse(lighthouse)
            raise RuntimeError(
                f"the torchft lighthouse did not start (exit code "
                f"{lighthouse.returncode}); its error is above"
            )
        time.sleep(0.01)
    return lighthouse, store.get(key).decode()


def start_for_agent(agent: Any, preexec: Callable[[], None]) -> None:
    """The lighthouse of ``fastft run --torchft`` (``agent``: its
    :class:`~fastft.launch.agent.Agent`, whose ``lighthouse`` and ``lighthouse_addr`` it
    sets)."""
    cfg = agent.config
    agent.lighthouse, agent.lighthouse_addr = start_lighthouse(
        kind=cfg.torchft,
        job=cfg.job,
        node_rank=cfg.node_rank,
        store=agent.store.raw,
        store_addr=agent.store_addr,
        min_replicas=cfg.min_replicas or 1,
        world_size=cfg.world_size,
        heartbeat_ms=cfg.lighthouse_heartbeat_ms,
        join_ms=cfg.lighthouse_join_ms,
        run_dir=str(agent.run_dir),
        secret_file=str(agent.secret_file),
        loopback=cfg.nnodes == 1,
        wait_s=cfg.store_wait_s,
        preexec=preexec,
    )


def stop_lighthouse(lighthouse: Any) -> None:
    if isinstance(lighthouse, subprocess.Popen):
        lighthouse.terminate()
        try:
            lighthouse.wait(timeout=5)
        except subprocess.TimeoutExpired:
            lighthouse.kill()
            lighthouse.wait()
    elif lighthouse is not None:
        lighthouse.shutdown()
