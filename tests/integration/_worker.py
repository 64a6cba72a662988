"""A worker for the integration tests: joins the bus, blocks in an interruptible allreduce,
and reports what interrupted it as one JSON line on stdout."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from fastft.bus import BusConfig, connect_store, tcpstore_bus
from fastft.interrupt import Interrupter, StepInterrupted, allreduce
from fastft.protocol import Fault, HangSuspected, Severity

JOB = "integ"


def main() -> None:
    rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    step = 5
    store = connect_store(f"127.0.0.1:{port}")
    intr = Interrupter().install()
    intr.begin_step(epoch=1, step=step)
    bus = tcpstore_bus(store, BusConfig(job=JOB, rank=rank, incarnation=os.getpid())).start()

    def on_message(msg):
        if isinstance(msg, Fault) and msg.epoch == 1:
            intr.interrupt(f"rank {msg.faulty_rank}: {msg.cause}", message=msg, epoch=1)
        elif isinstance(msg, HangSuspected):
            intr.interrupt(f"rank {msg.hung_rank} hung", message=msg)

    bus.subscribe(on_message)
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore("epoch1/", store), rank, world, datetime.timedelta(seconds=60)
    )
    allreduce(pg, [torch.ones(4)], intr)  # warm-up: every rank is connected
    store.add("ready", 1)
    while int(store.add("ready", 0)) < world:
        time.sleep(0.001)
    out: dict[str, object] = {"rank": rank}
    if rank == world - 1 and mode == "raise":
        time.sleep(0.5)  # the others are inside the allreduce by now
        try:
            raise ValueError("loss is NaN")
        except ValueError as e:
            bus.broadcast(
                Fault(
                    job=JOB,
                    epoch=1,
                    rank=rank,
                    incarnation=os.getpid(),
                    step=step,
                    severity=Severity.FAULT2,
                    cause=f"{type(e).__name__}: {e}",
                    faulty_rank=rank,
                    detail=traceback.format_exc(),
                )
            )
        out["raised"] = True
    elif rank == world - 1 and mode == "sigstop":
        store.set("stopped_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        t0 = time.monotonic()
        try:
            allreduce(pg, [torch.ones(1 << 16)], intr)  # the faulty rank never joins
            out["error"] = "allreduce returned"
        except StepInterrupted as e:
            out.update(
                interrupted=True,
                blocked_s=time.monotonic() - t0,
                source_rank=e.source_rank,
                step=e.step,
                reason=e.reason,
                msg_step=e.message.step if e.message else None,
                cause=getattr(e.message, "cause", None),
                stopped=getattr(e.message, "stopped", None),
            )
    print(json.dumps(out), flush=True)
    bus.close()
    intr.close()
    os._exit(0)  # the abandoned process group is never reused or torn down


if __name__ == "__main__":
    main()
