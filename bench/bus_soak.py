"""Bus soak: push a million messages through the TCPStore bus and watch the store host's
memory. One live subscriber (another process) reads everything; one "dead" subscriber
joins and never reads, so it must be evicted at ``max_queue`` and its queue drained.
The store is hosted in this process, so this process's RSS is the store's memory.
Results: bench/results/bus_soak.json and a table (RSS every 10 % of the run).

    python bench/bus_soak.py [--messages 1000000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402

JOB = "bench-soak"

READER = r"""
import sys, threading
from fastft.bus import BusConfig, connect_store, tcpstore_bus
port, total = int(sys.argv[1]), int(sys.argv[2])
store = connect_store(f"127.0.0.1:{port}")
got = [0]
done = threading.Event()
def cb(m):
    got[0] += 1
    if got[0] >= total:
        done.set()
ep = tcpstore_bus(store, BusConfig(job="bench-soak", rank=0, incarnation=1, max_queue=100000))
ep.subscribe(cb)
ep.start()
store.add("soak/ready", 1)
done.wait(timeout=1200)
print(got[0], ep.stats.malformed, flush=True)
ep.close()
"""


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    a = ap.parse_args()

    from fastft.bus import BusConfig, host_store, tcpstore_bus
    from fastft.protocol import Heartbeat

    store = host_store()
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(store.port), str(a.messages)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
    )
    try:
        while int(store.add("soak/ready", 0)) < 1:
            time.sleep(0.01)
        # a subscriber that joins and never reads (its process "hangs")
        dead = tcpstore_bus(store, BusConfig(job=JOB, rank=1, incarnation=1))
        dead._transport.join(dead._label())  # noqa: SLF001 - a member that never pops
        # Eviction is the publisher's policy: its max_queue bounds every queue it pushes to.
        # The reader may fall behind a flat-out publisher by more than the default 1024.
        pub = tcpstore_bus(
            store,
            BusConfig(job=JOB, rank=9, incarnation=1, subscribe=False, max_queue=100_000),
        )
        pub.start()
        rows = []
        t0 = time.perf_counter()
        msg = Heartbeat(job=JOB, epoch=0, rank=9, incarnation=1)
        every = max(1, a.messages // 10)
        for i in range(1, a.messages + 1):
            pub.broadcast(msg)
            if i % every == 0:
                rows.append(
                    {
                        "messages": i,
                        "elapsed_s": round(time.perf_counter() - t0, 1),
                        "store_host_rss_mib": round(rss_mib(), 1),
                        "evictions": pub.stats.evicted_peers,
                    }
                )
                print(rows[-1], flush=True)
        out, _ = reader.communicate(timeout=1200)
        got, malformed = map(int, out.split())
        pub.close()
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    path = write("bus_soak", rows, {"messages": a.messages, "delivered": got})
    print(f"Bus soak: {a.messages} broadcasts, {got} delivered to the live reader")
    print(table(rows, ["messages", "elapsed_s", "store_host_rss_mib", "evictions"]))
    print(f"written: {path}")
    if got != a.messages or malformed:
        sys.exit(f"lost messages: {got} of {a.messages} delivered, {malformed} malformed")


if __name__ == "__main__":
    main()
