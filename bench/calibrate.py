"""The scale model's calibration (issue 51): what each control-plane request costs the real
servers here, measured, written where the model reads it.

**TCPStore** (a store hosted by a process of its own, its CPU read from /proc): a client
makes ``--ops`` requests of each kind in a row; the server's CPU over them, per request, is
the request's server time; the client's wall per request less that is its round trip (the
loopback and the client's own stack). TCPStore's ``set`` is not answered (sets in a row
are batched by the server: 4 us each), so each ``set`` is followed by a ``check`` and the
check's cost taken off: a member's one set costs what a lone request does. Kinds: ``set``, ``get`` (TCPStore's client waits for
the key, then reads it: two requests), ``add``, ``check``, ``compare_set``, ``multi_get``
of 64 keys (the server time per key more than one), ``set`` of 64 KiB (per byte), and a
blocking ``get`` answered when the key is set (the server time per waiter woken, 64
waiters).

**NATS** (a local 3-server JetStream cluster, as ``fastft run --control nats`` starts, the
project's own client :class:`fastft.bus.nats.NatsKV`): the same kinds through the key-value
bucket; a write's server time is the busiest server's CPU per write (the stream's leader
orders every write), measured with 64 requests in flight (one at a time the Go runtimes
spin between requests: 3-10x the CPU a loaded server spends per request).

The model (:mod:`fastft.sim.costs`) reads ``src/fastft/sim/calibration.json``; ``--write``
replaces it with this run's figures. Printed: the table; written: bench/results/calibrate.json.

    python bench/calibrate.py [--ops 4000] [--planes tcpstore nats] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import StoreHost, table, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILE = ROOT / "src" / "fastft" / "sim" / "calibration.json"
VALUE = b"x" * 100
BIG = 64 * 1024
MANY = 64
WAITERS = 64


def _cpu(pids: list[int]) -> list[float]:
    import psutil

    out = []
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        out.append(float(t.user + t.system))
    return out


def _measure(
    client: object, pids: list[int], ops: int, kinds: dict[str, object]
) -> dict[str, tuple[float, float, float]]:
    """kind -> (wall per request, busiest server's CPU per request, all servers' CPU)."""
    out = {}
    for name, fn in kinds.items():
        fn()  # (warm: the key exists, the connection is up)
        client.check(["k"])  # type: ignore[attr-defined]
        c0, t0 = _cpu(pids), time.perf_counter()
        for _ in range(ops):
            fn()  # type: ignore[operator]
        client.check(["k"])  # type: ignore[attr-defined]  # (TCPStore's set does not wait)
        wall = (time.perf_counter() - t0) / ops
        time.sleep(0.05)
        used = [b - a for a, b in zip(c0, _cpu(pids), strict=True)]
        out[name] = (wall, max(used) / ops, sum(used) / ops)
    return out


def _waiters(make: object, write_key: object, pids: list[int], rounds: int = 20) -> float:
    """Server CPU per waiter woken by a write (``WAITERS`` blocked readers), less the write."""
    clients = [make() for _ in range(WAITERS)]  # type: ignore[operator]
    used = 0.0
    for i in range(rounds):
        key = f"wake/{i}"
        ready = threading.Barrier(WAITERS + 1)

        def wait(c: object, k: str = key, b: threading.Barrier = ready) -> None:
            b.wait()
            c.get(k)  # type: ignore[attr-defined]

        ts = [threading.Thread(target=wait, args=(c,)) for c in clients]
        for t in ts:
            t.start()
        ready.wait()
        time.sleep(0.3)  # (every waiter's request is at the server)
        c0 = _cpu(pids)
        write_key(key)  # type: ignore[operator]
        for t in ts:
            t.join(timeout=30)
        used += sum(b - a for a, b in zip(c0, _cpu(pids), strict=True))
    return used / rounds / WAITERS


def _kinds(c: Any, many: Any, *, answered: bool) -> dict[str, Any]:
    """The requests measured, by kind, on client ``c`` (its keys written first); ``many``:
    its read of many keys. ``answered`` False (TCPStore): a set is not answered, so each
    is followed by a check, whose cost is taken off after."""
    c.set("k", VALUE)
    keys = [f"m/{i}" for i in range(MANY)]
    for k in keys:
        c.set(k, VALUE)
    c.set("big", b"y" * BIG)
    n = [0]

    def cas() -> None:
        n[0] += 1
        c.compare_set("c", str(n[0] - 1) if n[0] > 1 else "", str(n[0]))

    def put(key: str, value: bytes) -> Any:
        return c.set(key, value) if answered else (c.set(key, value), c.check(["k"]))

    return {
        "set": lambda: put("k", VALUE),
        "get": lambda: c.get("k"),
        "add": lambda: c.add("a", 1),
        "check": lambda: c.check(["k"]),
        "compare_set": cas,
        "multi_get": lambda: many(keys),
        "set_big": lambda: put("big", b"y" * BIG),
    }


def tcpstore(ops: int) -> dict[str, float]:
    import torch.distributed as dist

    with StoreHost() as host:
        pids = [host._p.pid]  # noqa: SLF001 - the bench's own helper

        def make() -> dist.TCPStore:
            s = dist.TCPStore("127.0.0.1", host.port, is_master=False)
            s.set_timeout(datetime.timedelta(seconds=30))
            return s

        c = make()
        got = _measure(c, pids, ops, _kinds(c, c.multi_get, answered=False))
        wake = _waiters(make, lambda k: c.set(k, VALUE), pids)
    check = got["check"]
    for k in ("set", "set_big"):  # (a set is not answered: each was followed by a check)
        got[k] = tuple(a - b for a, b in zip(got[k], check, strict=True))  # type: ignore[assignment]
    return {**_fit(got, wake, gets_are_two=True), "push_s": wake}


def nats(ops: int) -> dict[str, float]:
    from fastft.bus.nats import connect_kv
    from fastft.bus.natscluster import LocalCluster

    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp) / "nats").start()
        try:
            pids = [p.pid for p in cluster.procs if p is not None]
            c = connect_kv(cluster.address, wait_s=20)
            got = _measure(c, pids, ops, _kinds(c, c.read_many, answered=True))
            for kind, burst in _bursts(c, pids, ops).items():  # (under load: see below)
                got[kind] = (got[kind][0], burst[0], burst[1])
            wake = _waiters(
                lambda: connect_kv(cluster.address, wait_s=20), lambda k: c.set(k, VALUE), pids
            )
            push = _pushes(c, cluster.address, pids, ops, got["set"][1])
            c.conn.close()
        finally:
            cluster.stop()
    return {**_fit(got, wake, gets_are_two=False), "push_s": push}


def _bursts(
    c: object, pids: list[int], ops: int, width: int = 64
) -> dict[str, tuple[float, float]]:
    """NATS's server time per write and per read under load: ``width`` requests in flight
    at once (one at a time, the servers' Go runtimes spin between requests and their CPU
    per request reads 3-10x what a loaded server spends: the model's queues are loaded)."""
    import asyncio

    kv = c.conn.kv  # type: ignore[attr-defined]
    out = {}
    for kind in ("set", "get"):

        async def one(i: int, kind: str = kind) -> None:
            if kind == "set":
                await kv.put(f"b.{i % 256}", VALUE)
            else:
                await kv.get(f"b.{i % 256}")

        async def wave(base: int) -> None:
            await asyncio.gather(*(one(base + j) for j in range(width)))

        c._call(lambda: wave(0))  # type: ignore[attr-defined]  # noqa: SLF001 - (every key written)
        c._call(lambda: wave(width))  # type: ignore[attr-defined]  # noqa: SLF001
        c0 = _cpu(pids)
        waves = max(ops // width, 4)
        for w in range(waves):
            c._call(lambda w=w: wave(w * width))  # type: ignore[attr-defined]  # noqa: SLF001
        used = [b - a for a, b in zip(c0, _cpu(pids), strict=True)]
        n = waves * width
        out[kind] = (max(used) / n, sum(used) / n)
    return out


def _pushes(
    c: object, address: str, pids: list[int], ops: int, write_s: float, subs: int = 32
) -> float:
    """NATS: the servers' time per write and subscriber to every write of the bucket
    (``subs`` connections subscribed to ``$KV.fastft.>``), less the write's own."""
    import asyncio

    from fastft.bus.nats import nats_connection
    from fastft.bus.natsio import BUCKET, run

    conns = [nats_connection(address, wait_s=20) for _ in range(subs)]
    for conn in conns:

        async def drop(msg: object) -> None:
            pass

        async def sub(nc: object = conn.nc) -> None:
            await nc.subscribe(f"$KV.{BUCKET}.>", cb=drop)  # type: ignore[attr-defined]
            await nc.flush()  # type: ignore[attr-defined]

        run(sub(), 10.0)
    kv = c.conn.kv  # type: ignore[attr-defined]

    async def wave(base: int, width: int = 64) -> None:
        await asyncio.gather(*(kv.put(f"p.{(base + j) % 256}", VALUE) for j in range(width)))

    waves = max(ops // 64, 4)
    c0 = _cpu(pids)
    for w in range(waves):
        c._call(lambda w=w: wave(w * 64))  # type: ignore[attr-defined]  # noqa: SLF001
    used = sum(b - a for a, b in zip(c0, _cpu(pids), strict=True)) / (waves * 64)
    for conn in conns:
        conn.close()
    return max(0.0, used - write_s) / subs


def _fit(
    got: dict[str, tuple[float, float, float]], wake: float, *, gets_are_two: bool
) -> dict[str, float]:
    """The model's constants from the measured kinds (seconds)."""
    one = {k: v[1] for k, v in got.items()}  # the busiest server's time per request
    per_request_server = {k: one[k] / (2 if k == "get" and gets_are_two else 1) for k in one}
    per_key = max(0.0, (one["multi_get"] - per_request_server["get"]) / (MANY - 1))
    per_byte = max(0.0, (one["set_big"] - one["set"]) / (BIG - len(VALUE)))
    rtt = min(v[0] - v[1] for k, v in got.items() if k in ("add", "check"))
    return {
        "rtt_s": max(rtt, 1e-6),
        "set_s": per_request_server["set"],
        "get_s": per_request_server["get"],
        "add_s": per_request_server["add"],
        "check_s": per_request_server["check"],
        "compare_set_s": per_request_server["compare_set"],
        "per_key_s": per_key,
        "per_byte_s": per_byte,
        "wake_s": wake,
        "read_share_s": got["get"][2] / 3 if not gets_are_two else per_request_server["get"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=4000)
    ap.add_argument("--planes", nargs="+", default=["tcpstore", "nats"])
    ap.add_argument("--write", action="store_true", help=f"replace {MODEL_FILE.name}")
    args = ap.parse_args()
    out = {}
    for plane in args.planes:
        out[plane] = tcpstore(args.ops) if plane == "tcpstore" else nats(max(args.ops // 4, 200))
    rows = [
        {
            "plane": p,
            **{
                k: f"{v * 1e6:.2f} us" if k != "per_byte_s" else f"{v * 1e9:.3f} ns"
                for k, v in c.items()
            },
        }  # fmt: skip
        for p, c in out.items()
    ]
    print(table(rows, list(rows[0])))
    meta = {"ops": args.ops, "value_bytes": len(VALUE), "many": MANY, "waiters": WAITERS}
    print(write("calibrate", rows, {**meta, "constants": out}))
    if args.write:
        old = json.loads(MODEL_FILE.read_text()) if MODEL_FILE.exists() else {}
        old.update(
            {
                p: {
                    **{k: float(f"{v:.3g}") for k, v in c.items()},
                    "measured": time.strftime("%Y-%m-%d"),
                }
                for p, c in out.items()
            }
        )
        MODEL_FILE.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
        print(f"wrote {MODEL_FILE}")


if __name__ == "__main__":
    main()
