"""Broadcast latency to the LAST of N subscribers: the TCPStore bus and the NATS bus (a
local 3-server cluster, ``fastft run --control``), side by side in one run; with
``--relay on off`` also each node's workers hearing the bus through their agent's relay
(``fastft run --bus-relay``, 8 workers a node by default), against every worker
subscribing to the store.

N = 4, 16, 64 by default; subscribers are threads spread over up to 8 processes (64 = 8 x
8). The publisher stamps CLOCK_MONOTONIC (shared by all processes of one machine) into the
message's ``step``; each subscriber records arrival - stamp; per message the latency is the
largest over all workers (a relay's agent receives too, and is not counted). On TCPStore
the store is a process of its own: its CPU per broadcast (less what it spends while no
message flows, measured first over as long) is what carries over from this 2-core machine
(the simulated subscribers' wake-ups share its cores). Results:
bench/results/bus_latency.json and a table.

    python bench/bus_latency.py [--messages 200] [--gap-ms MS] [--backends tcpstore nats]
        [--subscribers 4 16 64] [--relay off] [--per-node 8] [--name bus_latency]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import StoreHost, summary_ms, table, write  # noqa: E402

JOB = "bench-bus"

SUBSCRIBER = r"""
import json, sys, threading, time
from fastft.bus import BusConfig, RelayHub, connect_store, open_bus
from fastft.protocol.auth import JobSecret
address = sys.argv[1]
count, first_rank, messages, per_node = map(int, sys.argv[2:6])
secret = JobSecret.load(sys.argv[6]) if sys.argv[6] != "-" else None
store = connect_store(address)
eps, agents = [], []
done = threading.Semaphore(0)
relay = None
for i in range(count):
    if per_node and i % per_node == 0:  # a simulated node: its agent, the relay's hub
        cfg = BusConfig(job="bench-bus", rank=-1 - first_rank - i, incarnation=1, secret=secret)
        hub = RelayHub(cfg.max_queue, cfg.stale_s)
        agents.append(open_bus(store.clone(), cfg, hub=hub).start())
        relay = hub.address
    cfg = BusConfig(job="bench-bus", rank=first_rank + i, incarnation=1, secret=secret)
    ep = open_bus(store.clone(), cfg, relay=relay if per_node else None)
    got = []
    def cb(m, got=got):
        now = time.monotonic_ns()
        if m.epoch == 1:
            got.append((m.seq, (now - m.step) / 1e9))
            if len(got) == messages:
                done.release()
    ep.subscribe(cb)
    eps.append((ep.start(), got))
store.add("bench/ready", count)
for _ in eps:
    done.acquire(timeout=400)
print(json.dumps([g for _, g in eps]), flush=True)
for ep, _ in eps:
    ep.close()
for ep in agents:
    ep.close()
"""


def run(
    backend: str,
    n: int,
    messages: int,
    gap_s: float,
    nats: str,
    secret_file: str | None = None,
    per_node: int = 0,
) -> dict[str, object]:
    """``secret_file``: every frame sealed and checked with that job secret. ``per_node``:
    workers per simulated node hearing the bus through its agent's relay (0: every worker
    subscribes to the store)."""
    from fastft.bus import BusConfig, connect_store, open_bus
    from fastft.protocol import Heartbeat
    from fastft.protocol.auth import JobSecret

    secret = JobSecret.load(secret_file) if secret_file else None

    host = None
    if backend == "nats":
        store = connect_store(nats)
        address = nats
        store.set("bench/ready", "0")
    else:
        host = StoreHost().__enter__()
        address = f"127.0.0.1:{host.port}"
        store = connect_store(address)
    procs_n = min(8, max(1, n // per_node) if per_node else n)
    per = [n // procs_n + (1 if i < n % procs_n else 0) for i in range(procs_n)]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs, first = [], 0
    try:
        for count in per:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        SUBSCRIBER,
                        address,
                        str(count),
                        str(first),
                        str(messages),
                        str(per_node),
                        secret_file or "-",
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
            first += count
            # one process at a time: eight importing torch at once on a small machine stall
            # each other's store handshakes past connect_store's deadline
            deadline = time.monotonic() + 600
            while int(store.add("bench/ready", 0)) < first:
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise TimeoutError("subscribers did not start")
                time.sleep(0.05)
        cfg = BusConfig(job=JOB, rank=999, incarnation=1, subscribe=False, secret=secret)
        pub = open_bus(store, cfg).start()
        time.sleep(0.5)  # (the subscribers' first idle reads pass)
        # the store's CPU while no message flows (its subscribers' idle reads and liveness
        # writes), over as long as the messages will take: taken off their CPU below
        idle_s = messages * gap_s
        cpu0 = host.cpu_s() if host else 0.0
        time.sleep(idle_s)
        idle = (host.cpu_s() - cpu0) if host else 0.0
        cpu0 = host.cpu_s() if host else 0.0
        for _ in range(messages):
            pub.broadcast(
                Heartbeat(job=JOB, epoch=1, rank=999, incarnation=1, step=time.monotonic_ns())
            )
            time.sleep(gap_s)
        cpu = (host.cpu_s() - cpu0) if host else None
        per_msg: dict[int, float] = {}
        for p in procs:
            out, _ = p.communicate(timeout=600)
            for sub in json.loads(out):
                for seq, lat in sub:
                    per_msg[seq] = max(per_msg.get(seq, 0.0), lat)
        pub.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if host is not None:
            host.__exit__(None, None, None)
    assert len(per_msg) == messages, f"{len(per_msg)} of {messages} messages reached all"
    nodes = -(-n // per_node) if per_node else 0
    return {
        "backend": backend,
        "relay": f"{per_node} a node" if per_node else "off",
        "tags": secret is not None,
        "subscribers": n,
        "store_subscribers": nodes or n,
        "processes": procs_n,
        **summary_ms(list(per_msg.values())),
        "store_cpu_ms_per_msg": round((cpu - idle) * 1e3 / messages, 3)
        if cpu is not None
        else None,
        "store_cpu_idle_pct": round(100 * idle / idle_s, 1) if host else None,
    }


def main() -> None:
    import tempfile

    from fastft.bus.natscluster import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=None,
        help="between messages (default: 5 ms, or 0.25 ms per subscriber beyond 20: the "
        "simulated subscribers' own wake-ups must fit on the machine's cores between two)",
    )
    ap.add_argument("--subscribers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--backends", nargs="+", default=["tcpstore", "nats"])
    ap.add_argument("--relay", nargs="+", choices=["off", "on"], default=["off"])
    ap.add_argument("--per-node", type=int, default=8, help="workers per node with --relay on")
    ap.add_argument("--name", default="bus_latency", help="results: bench/results/NAME.json")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        cluster = LocalCluster(d).start() if "nats" in a.backends else None
        try:
            for n in a.subscribers:  # the backends and relays interleaved, per size
                for b in a.backends:
                    for relay in a.relay:
                        address = cluster.address if cluster else ""
                        per_node = a.per_node if relay == "on" else 0
                        gap_ms = a.gap_ms if a.gap_ms is not None else max(5.0, 0.25 * n)
                        rows.append(run(b, n, a.messages, gap_ms / 1e3, address, None, per_node))
                        rows[-1]["gap_ms"] = gap_ms
                        print(table(rows[-1:], list(rows[-1])), flush=True)
        finally:
            if cluster:
                cluster.stop()
    for n in a.subscribers:
        ref = next(
            (r for r in rows if r["subscribers"] == n and r["backend"] == "tcpstore"
             and r["relay"] == "off"),
            None,
        )  # fmt: skip
        for r in rows:
            if r["subscribers"] == n:
                r["p50_vs_tcpstore"] = r["p50_ms"] / ref["p50_ms"] if ref else "-"
    path = write(a.name, rows, {"messages": a.messages, "per_node": a.per_node})
    print("Broadcast -> last of N subscribers (loopback; NATS: a local 3-server cluster)")
    cols = ["backend", "relay", "subscribers", "store_subscribers", "processes", "n", "p50_ms",
            "p99_ms", "max_ms", "store_cpu_ms_per_msg", "store_cpu_idle_pct"]  # fmt: skip
    print(table(rows, [*cols, "p50_vs_tcpstore"]))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
