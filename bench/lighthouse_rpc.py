"""The lighthouse's own cost: torchft's Rust lighthouse and fastft's BusLighthouse (Python
gRPC) side by side, each in a process of its own, driven by torchft's Rust
``LighthouseClient`` as torchft's managers drive it:

* quorum rounds: 3 replicas ask for a quorum together, round after round (one round per
  training step); wall time and the server's CPU per round;
* heartbeats: 3 replicas beating every 100 ms (torchft's default interval); the server's
  CPU per heartbeat.

    python bench/lighthouse_rpc.py [--rounds 1000] [--beat-s 5]

Results: bench/results/lighthouse_rpc.json and a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil

sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402

SERVERS = {
    "torchft (Rust)": (
        "import sys\n"
        "from torchft._torchft import LighthouseServer\n"
        "lh = LighthouseServer(bind='127.0.0.1:0', min_replicas=1)\n"
        "print(lh.address().rpartition(':')[2], flush=True)\n"
        "sys.stdin.read()\n"
    ),
    "BusLighthouse (Python gRPC)": (
        "import sys\n"
        "from fastft.integrations.torchft import BusLighthouse\n"
        "lh = BusLighthouse().start()\n"
        "print(lh.port, flush=True)\n"
        "sys.stdin.read()\n"
    ),
}
REPLICAS = 3


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def measure(name: str, rounds: int, beat_s: float) -> dict[str, object]:
    from torchft._torchft import LighthouseClient

    env = {**os.environ, "RUST_LOG": "warn"}
    srv = subprocess.Popen(
        [sys.executable, "-c", SERVERS[name]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert srv.stdout is not None
        address = f"http://127.0.0.1:{int(srv.stdout.readline())}"
        proc = psutil.Process(srv.pid)
        clients = [LighthouseClient(address, timedelta(seconds=10)) for _ in range(REPLICAS)]
        for i, c in enumerate(clients):
            c.heartbeat(f"replica_{i}")
        barrier = threading.Barrier(REPLICAS)

        def ask(i: int, n: int) -> None:
            for step in range(n):
                barrier.wait(timeout=30)
                clients[i].quorum(
                    replica_id=f"replica_{i}", timeout=timedelta(seconds=10), step=step
                )

        def together(n: int) -> None:
            threads = [threading.Thread(target=ask, args=(i, n)) for i in range(REPLICAS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)

        together(30)  # warm-up: connections, first quorum
        c0, t0 = cpu_s(proc), time.monotonic()
        together(rounds)
        wall, cpu = time.monotonic() - t0, cpu_s(proc) - c0

        beats = 0
        c0, t0 = cpu_s(proc), time.monotonic()
        while time.monotonic() - t0 < beat_s:
            for i, c in enumerate(clients):
                c.heartbeat(f"replica_{i}")
                beats += 1
            time.sleep(0.1)
        beat_cpu = cpu_s(proc) - c0
        return {
            "lighthouse": name,
            "round_ms": round(wall / rounds * 1e3, 3),
            "cpu_per_round_ms": round(cpu / rounds * 1e3, 3),
            "cpu_per_heartbeat_ms": round(beat_cpu / beats * 1e3, 3),
        }
    finally:
        if srv.stdin is not None:
            srv.stdin.close()
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--beat-s", type=float, default=5.0)
    a = ap.parse_args()
    rows = [measure(name, a.rounds, a.beat_s) for name in SERVERS]
    per_round = [r["cpu_per_round_ms"] for r in rows]
    assert all(isinstance(v, float) for v in per_round)
    rust, ours = (float(v) for v in per_round)  # type: ignore[arg-type]
    meta = {
        "replicas": REPLICAS,
        "rounds": a.rounds,
        "cpu_per_round_ratio": round(ours / max(rust, 1e-9), 2),
    }
    path = write("lighthouse_rpc", rows, meta)
    print(table(rows, list(rows[0])))
    print(f"BusLighthouse / torchft CPU per round: {meta['cpu_per_round_ratio']}x")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
