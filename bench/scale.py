"""The fault-free step's decision at scale (issue 35): the store's vote against the step's
collective, side by side in one run.

**Store** (``--decide store``): N simulated members (threads, one store client each,
spread over a few processes) run the real ``Coordinator.vote`` and ``await_decision``
against one TCPStore hosted by a process of its own, and rank 0's key collector deletes
each decided step's keys and records it, as in a job. Every step starts on a common
schedule (every member's gradients are ready at once); the step's decision latency is the
time from its start to the last member having read the decision.

**Collective** (``--decide collective``, the default): the step's decision is the one
allreduce (max) of four int64 after the gradients, on the real Gloo process groups of N
processes; rank 0 records each decided step through the real key collector, as in a job,
its requests counted and the store host's CPU measured (at most one a step, coalesced
when the writes fall behind), whatever N.

Reported per row: the decision's latency p50/p99, the store host's CPU per step, the store
requests per step (all members, counted on their clients), and per member. What carries
over from this 2-core machine: the requests counted, and the store's CPU per request. The
simulated members' own overhead is in the N = 1 row. 16,384 is extrapolated from the
measured CPU per member-step (the store's server is one thread: its CPU per step is a
floor of the step's decision latency).

    python bench/scale.py [--sizes 1 8 64 256 1024] [--gloo 2 4 8] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import StoreHost, fan_out, pct, table, write  # noqa: E402

EXTRAPOLATE = 16384


def members(port: int, first: int, count: int, world: int, steps: int, period: float) -> None:
    """A child: ``count`` member threads (ranks first..) voting in the store for ``steps``
    steps; one JSON line: when each member read each step's decision, and the requests."""
    import datetime

    import torch.distributed as dist

    from fastft.protocol.keys import JobKeys
    from fastft.runtime.engine.coordinator import Coordinator
    from fastft.runtime.engine.sideclient import KeyCollector, SideClient
    from fastft.testing import CountingStore

    keys = JobKeys("scale")
    counts: dict[str, int] = {}
    lock = threading.Lock()
    ranks = tuple(range(world))

    def client(timeout_s: float = 300) -> object:
        raw = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300)
        )
        raw.set_timeout(datetime.timedelta(seconds=timeout_s))  # (after the connect)
        return CountingStore(raw, counts, lock)

    coords = [
        Coordinator(client(), keys, first + i, 1, world, world, decision_store=client(2))
        for i in range(count)
    ]
    collector = KeyCollector(SideClient(client(), keys)) if first == 0 else None
    read: dict[int, list[float]] = {s: [] for s in range(steps)}
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.time() + 0.5  # (every child got "go" by then)
    t0 = float(int(t0 * 10) + 1) / 10  # the same schedule in every child: wall clock

    def one(c: Coordinator) -> None:
        for s in range(steps):
            start = t0 + s * period
            time.sleep(max(0.0, start - time.time()))
            got = c.vote(1, s, world, ranks=ranks)
            while got is None:
                got = c.await_decision(1, s)
            with lock:
                read[s].append(time.time() - start)
            if c.me.rank == 0 and collector is not None and s > 0:
                collector.put(1, s - 1)

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if collector is not None:
        time.sleep(0.2)
        collector.close()
    requests = sum(counts.values())
    print(json.dumps({"read": read, "requests": requests, "t0": t0}), flush=True)


def store_row(world: int, procs: int, steps: int) -> dict[str, object]:
    period = max(0.05, world * 0.0006)  # longer than a step's decision takes here
    per = -(-world // procs)
    children = [
        [str(first), str(min(per, world - first)), str(world), str(steps), str(period)]
        for first in range(0, world, per)
    ]
    with StoreHost() as host:
        outs, cpu, _ = fan_out(host, __file__, [[str(host.port), *c] for c in children], 600)
    last = [max(t for o in outs for t in o["read"][str(s)]) for s in range(steps)]
    requests = sum(int(o["requests"]) for o in outs) / steps
    warm = last[2:]  # (the first steps connect)
    cpu_ms = cpu / steps * 1e3
    return {
        "decide": "store",
        "ranks": world,
        "p50_ms": round(pct(warm, 50) * 1e3, 2),
        "p99_ms": round(pct(warm, 99) * 1e3, 2),
        "store_cpu_ms_per_step": round(cpu_ms, 2),
        "requests_per_step": round(requests, 1),
        "requests_per_rank_step": round(requests / world, 2),
    }


def gloo_member(port: int, rank: int, world: int, steps: int) -> None:
    """A child: one Gloo member; one JSON line: each decision allreduce's time (rank 0)."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore("scale/", store), rank, world, datetime.timedelta(seconds=60)
    )
    from fastft.protocol.keys import JobKeys
    from fastft.runtime.engine.sideclient import KeyCollector, SideClient
    from fastft.testing import CountingStore

    # what a job's members ask the store per decided step: rank 0 records the committed
    # step off the step's path (its key collector), counted; the others' clients, none
    counts: dict[str, int] = {}
    collector = (
        KeyCollector(SideClient(CountingStore(store.clone(), counts), JobKeys("scale")))
        if rank == 0
        else None
    )
    print("ready", flush=True)
    sys.stdin.readline()
    flags = torch.zeros(4, dtype=torch.int64)
    times = []
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    for step in range(steps + 5):
        pg.allreduce([flags], opts).wait()  # (aligns the members before each timed one)
        t = time.perf_counter()
        pg.allreduce([flags], opts).wait()
        times.append(time.perf_counter() - t)
        if collector is not None:
            collector.record(step)
    if collector is not None:
        time.sleep(0.2)  # (the last record written)
        collector.close()
    requests = sum(v for k, v in counts.items() if k != "set_timeout")
    print(json.dumps({"times": times[5:], "requests": requests}), flush=True)


def collective_row(world: int, steps: int) -> dict[str, object]:
    with StoreHost() as host:
        outs, cpu, _ = fan_out(
            host,
            __file__,
            [["gloo", str(host.port), str(r), str(world), str(steps)] for r in range(world)],
            300,
        )
    times = outs[0]["times"]
    decided = steps + 5
    requests = sum(int(o["requests"]) for o in outs) / decided
    return {
        "decide": "collective",
        "ranks": world,
        "p50_ms": round(pct(times, 50) * 1e3, 3),
        "p99_ms": round(pct(times, 99) * 1e3, 3),
        "store_cpu_ms_per_step": round(cpu / decided * 1e3, 3),
        "requests_per_step": round(requests, 2),
        "requests_per_rank_step": round(requests / world, 4),
    }


def main() -> None:
    if sys.argv[1:3] == ["--child", "gloo"]:
        a = sys.argv[3:]
        gloo_member(int(a[0]), int(a[1]), int(a[2]), int(a[3]))
        return
    if sys.argv[1:2] == ["--child"]:
        a = sys.argv[2:]
        members(int(a[0]), int(a[1]), int(a[2]), int(a[3]), int(a[4]), float(a[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    ap.add_argument("--gloo", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--procs", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        rows.append(store_row(n, min(args.procs, n), args.steps))
        print(json.dumps(rows[-1]), flush=True)
    for n in args.gloo:
        rows.append(collective_row(n, args.steps * 10))
        print(json.dumps(rows[-1]), flush=True)
    big = [r for r in rows if r["decide"] == "store" and int(r["ranks"]) >= 64]  # type: ignore[arg-type]
    extrapolated = None
    if big:
        per_member_ms = max(
            float(r["store_cpu_ms_per_step"]) / int(r["ranks"])  # type: ignore[arg-type]
            for r in big
        )
        extrapolated = {
            "ranks": EXTRAPOLATE,
            "store_cpu_ms_per_step_store": round(per_member_ms * EXTRAPOLATE, 1),
            "requests_per_step_store": round(
                float(big[-1]["requests_per_rank_step"]) * EXTRAPOLATE  # type: ignore[arg-type]
            ),
            "requests_per_step_collective": 1,
        }
    cols = ["decide", "ranks", "p50_ms", "p99_ms", "store_cpu_ms_per_step"]
    print(table(rows, [*cols, "requests_per_step", "requests_per_rank_step"]))
    if extrapolated:
        print(
            f"at {EXTRAPOLATE} ranks (extrapolated from the largest CPU per member-step "
            f"measured): store {extrapolated['store_cpu_ms_per_step_store']} ms of store CPU "
            f"and {extrapolated['requests_per_step_store']} requests per step; collective: "
            "1 request per step"
        )
    path = write("scale", rows, {"procs": args.procs, "extrapolated": extrapolated})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
