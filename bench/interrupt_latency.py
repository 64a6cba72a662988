"""Interrupt latency: bus message received (listener callback entered) -> the main thread
has caught StepInterrupted, for a main thread that is sleeping, in a busy Python loop,
waiting in torch Future.wait(), and blocked in a Gloo allreduce whose peer is SIGSTOPped
(3 processes). Results: bench/results/interrupt_latency.json and a table.

    python bench/interrupt_latency.py [--trials 200] [--collective-trials 15]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import summary_ms, table, write  # noqa: E402

JOB = "bench-int"


def in_process(case: str, trials: int) -> list[float]:
    import torch

    from fastft.bus import BusConfig, host_store, tcpstore_bus
    from fastft.interrupt import FutureCancelled, Interrupter, StepInterrupted
    from fastft.protocol import Fault, Severity

    store = host_store()
    intr = Interrupter().install()
    t_recv: list[float] = []
    sub = tcpstore_bus(store, BusConfig(job=JOB, rank=0, incarnation=1)).start()

    def on_msg(m: object) -> None:
        t_recv.append(time.perf_counter())
        intr.interrupt("peer fault", message=m)  # type: ignore[arg-type]

    sub.subscribe(on_msg)
    pub = tcpstore_bus(store, BusConfig(job=JOB, rank=1, incarnation=1, subscribe=False)).start()
    fault = Fault(
        job=JOB,
        epoch=0,
        rank=1,
        incarnation=1,
        severity=Severity.FAULT2,
        cause="bench",
        faulty_rank=1,
    )
    out = []
    for i in range(trials):
        intr.begin_step(0, i)
        t_recv.clear()
        timer = threading.Timer(0.002, pub.broadcast, args=(fault,))
        try:
            # Armed from here on: the interrupt may land while start() still waits for the
            # timer thread, so start() belongs inside the try, like all code after arming.
            timer.start()
            if case == "sleeping":
                time.sleep(10)
            elif case == "busy":
                while True:
                    pass
            elif case == "future":
                fut: torch.futures.Future[None] = torch.futures.Future()
                with intr.pending(fut):
                    try:
                        fut.wait()
                    except FutureCancelled:
                        intr.raise_if_interrupted()
        except StepInterrupted:
            t_caught = time.perf_counter()
        timer.join()
        out.append(t_caught - t_recv[0])
    sub.close()
    pub.close()
    intr.close()
    return out


COLLECTIVE_WORKER = r"""
import datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
from fastft.bus import BusConfig, connect_store, tcpstore_bus
from fastft.interrupt import Interrupter, StepInterrupted, allreduce
from fastft.protocol import HangSuspected
rank, port, trials = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = connect_store(f"127.0.0.1:{port}")
intr = Interrupter().install()
recv = []
bus = tcpstore_bus(store, BusConfig(job="bench-int", rank=rank, incarnation=os.getpid())).start()
def cb(m):
    if isinstance(m, HangSuspected) and m.hung_rank != rank:  # not about ourselves
        recv.append(time.perf_counter())
        intr.interrupt("peer stopped", message=m, step=m.step)
bus.subscribe(cb)
lat = []
for i in range(trials):
    intr.begin_step(0, i)
    recv.clear()
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"t{i}/", store), rank, 3,
                               datetime.timedelta(seconds=60))
    allreduce(pg, [torch.ones(4)], intr)
    if rank == 2:
        store.set(f"stop/{i}", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        continue
    store.add(f"in/{i}", 1)  # the agent waits for both survivors to get here
    try:
        allreduce(pg, [torch.ones(1024)], intr)
    except StepInterrupted:
        lat.append(time.perf_counter() - recv[0])
    store.add(f"done/{i}", 1)
print(json.dumps(lat), flush=True)
bus.close()
os._exit(0)
"""


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def collective(trials: int) -> list[float]:
    from fastft.bus import BusConfig, host_store, tcpstore_bus
    from fastft.protocol import HangSuspected

    store = host_store()
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COLLECTIVE_WORKER, str(r), str(store.port), str(trials)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(3)
    ]
    agent = tcpstore_bus(store, BusConfig(job=JOB, rank=-1, incarnation=7, subscribe=False)).start()
    try:
        for i in range(trials):
            pid = int(store.get(f"stop/{i}"))
            while _proc_state(pid) != "T":
                time.sleep(0.001)
            while int(store.add(f"in/{i}", 0)) < 2:
                time.sleep(0.001)
            time.sleep(0.05)  # survivors are blocked in the measured allreduce
            agent.broadcast(
                HangSuspected(
                    job=JOB,
                    epoch=0,
                    rank=-1,
                    incarnation=7,
                    step=i,
                    hung_rank=2,
                    hung_incarnation=pid,
                    silent_for_s=0.0,
                    stopped=True,
                )
            )
            while int(store.add(f"done/{i}", 0)) < 2:
                time.sleep(0.001)
            os.kill(pid, signal.SIGCONT)
        lat: list[float] = []
        for p in procs[:2]:
            out, _ = p.communicate(timeout=120)
            lat += json.loads(out)
        procs[2].communicate(timeout=120)
    finally:
        agent.close()
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--collective-trials", type=int, default=15)
    a = ap.parse_args()
    rows = []
    for case in ("sleeping", "busy", "future"):
        rows.append({"blocked_in": case, **summary_ms(in_process(case, a.trials))})
    if a.collective_trials > 0:
        rows.append(
            {
                "blocked_in": "gloo allreduce, SIGSTOPped peer (3 procs)",
                **summary_ms(collective(a.collective_trials)),
            }
        )
    path = write("interrupt_latency", rows, {"trials": a.trials})
    print("Interrupt latency: bus message received -> main thread interrupted")
    print(table(rows, ["blocked_in", "n", "p50_ms", "p99_ms", "max_ms"]))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
