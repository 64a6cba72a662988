"""What the job secret's tags cost (issue 21), side by side in one run, with and without:

1. per message: sealing (encode + HMAC) and opening (HMAC + decode + replay check), in
   microseconds, against encoding and decoding alone;
2. broadcast latency to the last of 16 and 64 subscribers (the TCPStore bus), tags on
   and off, interleaved;
3. per fault-free step: the demo (3 Gloo workers, 10.8k parameters) under ``fastft run``
   with the tags and with ``FASTFT_INSECURE_NO_AUTH=1``, interleaved pairs.

Targets: <= 50 us per message, <= 0.2 ms per step. Results: bench/results/auth_cost.json
and a table.

    python bench/auth_cost.py [--messages 200] [--steps 300] [--pairs 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402
from bus_latency import run as broadcast  # noqa: E402

from fastft.protocol import Fault, Role, Severity, decode, encode  # noqa: E402
from fastft.protocol.auth import JobSecret, MessageAuth, ReplayGuard  # noqa: E402


def per_message(n: int) -> list[dict[str, object]]:
    auth = MessageAuth(JobSecret.draw())
    guard = ReplayGuard(time.time())
    msgs = [
        Fault(
            job="bench",
            epoch=3,
            rank=1,
            incarnation=77,
            step=i,
            role=Role.WORKER,
            seq=i + 1,
            wall_time=time.time(),
            severity=Severity.FAULT2,
            cause="exception",
            faulty_rank=1,
            detail="x" * 200,
        )  # fmt: skip
        for i in range(n)
    ]
    nonce = os.urandom(8)
    t0 = time.perf_counter()
    plain = [encode(m) for m in msgs]
    t1 = time.perf_counter()
    for d in plain:
        decode(d, job="bench")
    t2 = time.perf_counter()
    sealed = [auth.seal(encode(m), nonce) for m in msgs]
    t3 = time.perf_counter()
    for d in sealed:
        body, nn = auth.open(d)
        m = decode(body, job="bench")
        assert guard.check((int(m.role), m.rank, m.incarnation, nn), m.seq, m.wall_time) is None
    t4 = time.perf_counter()
    us = 1e6 / n
    rows = [
        {"what": "send (encode)", "tags": False, "us_per_msg": (t1 - t0) * us},
        {"what": "send (encode)", "tags": True, "us_per_msg": (t3 - t2) * us},
        {"what": "receive (decode)", "tags": False, "us_per_msg": (t2 - t1) * us},
        {"what": "receive (decode)", "tags": True, "us_per_msg": (t4 - t3) * us},
    ]
    rows.append(
        {
            "what": "added per message (send + receive)",
            "tags": True,
            "us_per_msg": (t3 - t2 + t4 - t3 - (t1 - t0) - (t2 - t1)) * us,
        }
    )
    return rows


def per_step(tmp: Path, tags: bool, steps: int, i: int) -> float:
    run = tmp / f"step-{'tags' if tags else 'none'}-{i}"
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    if not tags:
        env["FASTFT_INSECURE_NO_AUTH"] = "1"
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)),
        *("--job", run.name, "-m", "fastft.demo.train", "--", "--steps", str(steps)),
        *("--hidden", "88"),
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=900)
    from fastft.report import summarize

    return float(summarize(run)["median_step_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-message", type=int, default=20000)
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--subscribers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=6)
    a = ap.parse_args()
    msg_rows = per_message(a.per_message)
    bus_rows: list[dict[str, object]] = []
    step_rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        secret = JobSecret.draw().save(tmp / "job.secret")
        for n in a.subscribers:  # with and without, interleaved per size
            for tags in (False, True):
                bus_rows.append(
                    broadcast("tcpstore", n, a.messages, 0.005, "", str(secret) if tags else None)
                )
        times: dict[bool, list[float]] = {False: [], True: []}  # (pair i: index i)
        for i in range(a.pairs):
            for tags in (False, True) if i % 2 == 0 else (True, False):
                times[tags].append(per_step(tmp, tags, a.steps, i))
        for tags in (False, True):
            step_rows.append(
                {
                    "tags": tags,
                    "runs": len(times[tags]),
                    "median_step_ms": statistics.median(times[tags]),
                    "all_ms": " ".join(f"{t:.3f}" for t in times[tags]),
                }
            )
    for n in a.subscribers:
        off, on = (r for r in bus_rows if r["subscribers"] == n)
        on["p50_added_ms"] = float(on["p50_ms"]) - float(off["p50_ms"])  # type: ignore[arg-type]
        off["p50_added_ms"] = 0.0
    diffs = [on - off for on, off in zip(times[True], times[False], strict=True)]
    added_step = statistics.median(diffs)  # of the paired differences
    added_msg = float(msg_rows[-1]["us_per_msg"])  # type: ignore[arg-type]
    path = write(
        "auth_cost",
        [*msg_rows, *bus_rows, *step_rows],
        {
            "added_us_per_message": added_msg,
            "added_ms_per_step": added_step,
            "paired_differences_ms": diffs,
            "targets": {"us_per_message": 50, "ms_per_step": 0.2},
        },
    )
    print("The job secret's tags, per message (a Fault of 200 characters)")
    print(table(msg_rows, ["what", "tags", "us_per_msg"]))
    print("\nBroadcast -> last of N subscribers (TCPStore bus, loopback)")
    print(table(bus_rows, ["tags", "subscribers", "n", "p50_ms", "p99_ms", "p50_added_ms"]))
    print("\nFault-free step, 3 Gloo workers, 10.8k parameters (median step of each run)")
    print(table(step_rows, ["tags", "runs", "median_step_ms", "all_ms"]))
    print(
        f"\nadded: {added_msg:.1f} us per message (target 50), {added_step:+.3f} ms per step "
        f"(target 0.2; median of the paired differences {' '.join(f'{d:+.3f}' for d in diffs)})"
    )
    print(f"written: {path}")


if __name__ == "__main__":
    main()
