"""Node leases at scale (issue 35): every agent reading every lease (before) against each
agent reading the leases of the next ``WATCHERS`` nodes on the ring (after), side by side;
and (issue 64) the ring's beats through the store against beats from agent to agent
(``--node-beats peers``: each agent's beat server, its watchers connected to it; the store
reads only the marks), side by side.

K simulated agents (the real ``NodeLease`` threads, each with its own store client, spread
over a few processes) renew and read against one real TCPStore hosted by a process of its
own, for a few seconds per configuration. Reported per configuration: the keys read per
round (all agents), the rounds each agent completed per second (the target is one per
heartbeat: 10/s), the read round trip p50/p99, the store host's CPU (share of one core)
and false losses (a node declared lost while it renewed, before the processes stop their
leases one after another: must be 0). What carries over
from this 2-core machine: the keys read per round and the store's CPU per round.

    python bench/leases.py [--sizes 16 64 256 1024] [--seconds 4] [--procs 4]
                           [--beats store peers]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import StoreHost, fan_out, pct, table, write  # noqa: E402


def agents(
    port: int, first: int, count: int, nnodes: int, watchers: int, seconds: float, beats: str
) -> None:
    """A child: ``count`` lease threads (nodes first..), then one JSON line of results."""
    import datetime

    import torch.distributed as dist

    from fastft.launch.nodes.lease import NodeLease
    from fastft.launch.nodes.peerbeats import PeerBeats, PeerLease
    from fastft.launch.rules.leasewatch import LeaseConfig
    from fastft.protocol.keys import JobKeys

    keys = JobKeys("leases")
    cfg = LeaseConfig(heartbeat_ms=100, misses=3)
    reads: list[float] = []
    lost: list[int] = []
    lock = threading.Lock()

    class Timing:
        def _read(self):  # type: ignore[no-untyped-def]
            t0 = time.monotonic()
            got = super()._read()  # type: ignore[misc]
            with lock:
                reads.append(time.monotonic() - t0)
            return got

    class Timed(Timing, NodeLease):
        pass

    class TimedPeers(Timing, PeerLease):
        pass

    def plain(key: str, value: str) -> str:
        return value

    def unsigned(key: str, raw: bytes) -> str:
        return bytes(raw).decode()

    def never(*a: object) -> None:
        pass

    went = [0.0]

    def on_lost(node: int, lives: object, counter: int) -> None:
        # (the processes end their leases one after another: a node declared once its
        # own process stopped is no false loss)
        if time.monotonic() - went[0] < seconds:
            lost.append(node)

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
    )
    for n in range(first, first + count):
        store.set(keys.node_lives(n), f"{n}:1")

    def make(n: int) -> NodeLease:
        for _ in range(10):  # (hundreds of clients connecting at once: the store lags)
            try:
                kind: Any = Timed
                if beats == "peers":
                    own = PeerBeats(
                        store, keys, n, plain, unsigned, toward=f"127.0.0.1:{port}",
                        timeout_s=cfg.lease_s,
                    )  # fmt: skip
                    kind = functools.partial(TimedPeers, beats=own)
                return kind(
                    store,
                    keys,
                    n,
                    nnodes,
                    cfg,
                    on_lost=on_lost,
                    on_fenced=never,
                    on_store_lost=never,
                    watchers=watchers,
                )
            except dist.DistStoreError:
                time.sleep(0.5)
        raise RuntimeError(f"node {n}: the store did not answer at start")

    leases = [make(n) for n in range(first, first + count)]
    print("ready", flush=True)
    sys.stdin.readline()  # go
    went[0] = time.monotonic()
    for lease in leases:
        lease.start()
    time.sleep(seconds)
    renewals = sum(lease.renewals - 1 for lease in leases)  # (not the one at its start)
    for lease in leases:
        lease.stop()  # (all at once, then each waited for)
    for lease in leases:
        lease.close()
    print(json.dumps({"reads": reads, "lost": lost, "renewals": renewals}), flush=True)


def run(nnodes: int, watchers: int, seconds: float, procs: int, beats: str) -> dict[str, object]:
    per = -(-nnodes // procs)
    children = [
        [str(first), str(min(per, nnodes - first)), str(nnodes), str(watchers), str(seconds)]
        + [beats]
        for first in range(0, nnodes, per)
    ]
    with StoreHost() as host:
        outs, cpu, wall = fan_out(
            host, __file__, [[str(host.port), *c] for c in children], seconds + 120
        )
    reads = [r for o in outs for r in o["reads"]]
    renewals = sum(o["renewals"] for o in outs)
    width = min(watchers, nnodes - 1)
    return {
        "nodes": nnodes,
        "mode": "every lease" if watchers >= nnodes - 1 else f"ring of {watchers}",
        "beats": beats,
        "keys_per_round": nnodes * (2 * width + 2) if beats == "store" else 0,
        "rounds_per_agent_s": round(renewals / nnodes / seconds, 2),
        "read_p50_ms": round(statistics.median(reads) * 1e3, 3),
        "read_p99_ms": round(pct(reads, 99) * 1e3, 3),
        "store_cpu_core": round(cpu / wall, 3),
        "false_losses": sum(len(o["lost"]) for o in outs),
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        a = sys.argv[2:]
        agents(int(a[0]), int(a[1]), int(a[2]), int(a[3]), int(a[4]), float(a[5]), a[6])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--all-up-to", type=int, default=256, help="every-lease mode up to N nodes")
    ap.add_argument("--beats", nargs="+", default=["store"], choices=["store", "peers"])
    args = ap.parse_args()
    from fastft.launch.rules.leasewatch import WATCHERS

    rows = []
    for n in args.sizes:
        modes = [WATCHERS] + ([n - 1] if n <= args.all_up_to and n - 1 > WATCHERS else [])
        for w in modes:
            for beats in args.beats if w == WATCHERS else ["store"]:
                row = run(n, w, args.seconds, args.procs, beats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    cols = [
        "nodes",
        "mode",
        "beats",
        "keys_per_round",
        "rounds_per_agent_s",
        "read_p50_ms",
        "read_p99_ms",
        "store_cpu_core",
        "false_losses",
    ]
    print(table(rows, cols))
    path = write("leases", rows, {"seconds": args.seconds, "procs": args.procs})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
