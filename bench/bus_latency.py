"""Broadcast latency to the LAST of N subscribers: the TCPStore bus and the NATS bus (a
local 3-server cluster, ``fastft run --control``), side by side in one run.

N = 4, 16, 64; subscribers are threads spread over up to 8 processes (64 = 8 x 8). The
publisher stamps CLOCK_MONOTONIC (shared by all processes of one machine) into the
message's ``step``; each subscriber records arrival - stamp; per message the latency is the
largest over all subscribers. Results: bench/results/bus_latency.json and a table.

    python bench/bus_latency.py [--messages 200] [--gap-ms 5] [--backends tcpstore nats]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import summary_ms, table, write  # noqa: E402

JOB = "bench-bus"

SUBSCRIBER = r"""
import json, sys, threading, time
from fastft.bus import BusConfig, connect_store, open_bus
from fastft.protocol.auth import JobSecret
address = sys.argv[1]
count, first_rank, messages = map(int, sys.argv[2:5])
secret = JobSecret.load(sys.argv[5]) if sys.argv[5] != "-" else None
store = connect_store(address)
lat = {}
eps = []
done = threading.Semaphore(0)
for i in range(count):
    cfg = BusConfig(job="bench-bus", rank=first_rank + i, incarnation=1, secret=secret)
    ep = open_bus(store.clone(), cfg)
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
"""


def run(
    backend: str, n: int, messages: int, gap_s: float, nats: str, secret_file: str | None = None
) -> dict[str, object]:
    """``secret_file``: every frame sealed and checked with that job secret."""
    from fastft.bus import BusConfig, connect_store, host_store, open_bus
    from fastft.protocol import Heartbeat
    from fastft.protocol.auth import JobSecret

    secret = JobSecret.load(secret_file) if secret_file else None

    if backend == "nats":
        store = connect_store(nats)
        address = nats
        store.set("bench/ready", "0")
    else:
        store = host_store()
        address = f"127.0.0.1:{store.port}"
    procs_n = min(8, n)
    per = [n // procs_n + (1 if i < n % procs_n else 0) for i in range(procs_n)]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs, first = [], 0
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
        deadline = time.monotonic() + 120
        while int(store.add("bench/ready", 0)) < first:
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                for p in procs:
                    p.kill()
                raise TimeoutError("subscribers did not start")
            time.sleep(0.05)
    try:
        cfg = BusConfig(job=JOB, rank=999, incarnation=1, subscribe=False, secret=secret)
        pub = open_bus(store, cfg).start()
        for _ in range(messages):
            pub.broadcast(
                Heartbeat(job=JOB, epoch=1, rank=999, incarnation=1, step=time.monotonic_ns())
            )
            time.sleep(gap_s)
        per_msg: dict[int, float] = {}
        for p in procs:
            out, _ = p.communicate(timeout=400)
            for sub in json.loads(out):
                for seq, lat in sub:
                    per_msg[seq] = max(per_msg.get(seq, 0.0), lat)
        pub.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(per_msg) == messages, f"{len(per_msg)} of {messages} messages reached all"
    return {
        "backend": backend,
        "tags": secret is not None,
        "subscribers": n,
        "processes": procs_n,
        **summary_ms(list(per_msg.values())),
    }


def main() -> None:
    import tempfile

    from fastft.bus.natscluster import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--subscribers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--backends", nargs="+", default=["tcpstore", "nats"])
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        cluster = LocalCluster(d).start() if "nats" in a.backends else None
        try:
            for n in a.subscribers:  # the backends interleaved, per size
                for b in a.backends:
                    address = cluster.address if cluster else ""
                    rows.append(run(b, n, a.messages, a.gap_ms / 1e3, address))
        finally:
            if cluster:
                cluster.stop()
    for n in a.subscribers:
        by = {r["backend"]: r for r in rows if r["subscribers"] == n}
        for r in by.values():
            ref = by.get("tcpstore")
            r["p50_vs_tcpstore"] = r["p50_ms"] / ref["p50_ms"] if ref else "-"
    path = write("bus_latency", rows, {"messages": a.messages, "gap_ms": a.gap_ms})
    print("Broadcast -> last of N subscribers (loopback; NATS: a local 3-server cluster)")
    cols = ["backend", "subscribers", "processes", "n", "p50_ms", "p99_ms", "max_ms"]
    print(table(rows, [*cols, "p50_vs_tcpstore"]))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
