"""Interruptible collectives for the runtime.

Each helper issues the operation with ``async_op`` semantics and waits on a future of our
own that the work's completion resolves *or* the :class:`Interrupter` fails, so a rank
blocked on a hung (SIGSTOPped) peer is released in well under a millisecond instead of
after Gloo's timeout. A process group abandoned with an operation in flight must not be
reused: the runtime builds a new one for the next epoch.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastft.interrupt.contract import CollectiveFailed
from fastft.interrupt.interrupter import Interrupter

__all__ = [
    "relay",
    "wait_work",
    "allreduce",
    "broadcast",
    "start_broadcast",
    "broadcast_bytes",
    "barrier",
]


def _collective_failed(e: Exception) -> Exception:
    return CollectiveFailed(f"collective failed: {e}")


def relay(
    target: torch.futures.Future[Any],
    wrap: Callable[[Exception], Exception] = _collective_failed,
    first: Callable[[], None] | None = None,
) -> Callable[[torch.futures.Future[Any]], None]:
    """A callback for a work's future that completes ``target`` with its result, or fails
    it with ``wrap(exception)``, unless ``target`` was failed first (by an interrupt or a
    bus fault). ``first``: called before, on the completing thread."""

    def cb(src: torch.futures.Future[Any]) -> None:
        if first is not None:
            first()
        try:
            value = src.value()
        except Exception as e:  # the collective failed by itself
            try:
                target.set_exception(wrap(e))
            except RuntimeError:
                pass
            return
        try:
            target.set_result(value)
        except RuntimeError:  # already failed by an interrupt
            pass

    return cb


_SLICE = datetime.timedelta(milliseconds=1)
"""CPU works: the longest a completion or an interrupt waits to be seen in a slice."""
_SPIN_S = 200e-6
"""GPU works: how long :func:`_wait_gpu` polls without sleeping before it backs off."""
_POLL_MAX_S = 500e-6
"""GPU works: the longest sleep between two polls (the most a completion is noticed late)."""


def wait_work(work: dist.Work, interrupter: Interrupter, *, gpu: bool = False) -> None:
    """Wait for ``work``; raise StepInterrupted on an interrupt, CollectiveFailed if the
    collective itself failed (e.g. a peer's connection was reset). ``gpu``: the work's
    tensors are on a GPU; return only once the GPU has finished it (see :func:`_wait_gpu`),
    polling the work alone: NCCL's future says nothing more (it is done at the enqueue)."""
    # Waited on from this thread, never by a Python callback on the work's future: a work
    # abandoned on a dead peer fails later, perhaps while the interpreter finalizes, and
    # torch then runs (or frees) its Python callback on a Gloo thread that can no longer
    # take the GIL; the thread exits through C++ frames and the process aborts
    # ("terminate called after throwing an instance of 'gloo::IoException'") instead of
    # ending with its status. Seen in 1 of 4 runs of a fault test.
    if gpu:
        _wait_gpu(work, interrupter)
    else:
        _wait_cpu(work, interrupter)


def _wait_cpu(work: dist.Work, interrupter: Interrupter) -> None:
    """Wait for a CPU work (Gloo) in slices of :data:`_SLICE`: each a blocking wait on the
    work's condition, which returns the moment the work completes, then a check of the
    interrupter. (Polled with sleeps, a completion was seen up to 0.5 ms late, and the
    first 0.2 ms of spinning took a core from the peers the step waits for: 3 ms a step
    of 7 with 3 workers on 2 cores, issue 65.) A slice that runs out leaves the work as it
    was ("Operation timed out!", the work not completed); a work that completed with an
    error raises it."""
    while True:
        interrupter.check()
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            if not work.is_completed():
                continue  # (the slice ran out)
        try:  # (completed as the slice ran out, or with an error: which one, at once)
            work.wait()
            return
        except Exception as e:
            interrupter.check()
            raise CollectiveFailed(f"collective failed: {e}") from e


def _wait_gpu(work: dist.Work, interrupter: Interrupter) -> None:
    """Poll ``work`` until it is done (any backend; the name is its first reason). NCCL completes a work's future as soon as the collective is *enqueued* on its
    stream; the result is ordered for later kernels, but the host has not seen it finish.
    A step must not vote COMMIT on a reduction that a dead peer may never finish, so poll
    the work's end event (``is_completed``: a non-blocking event query) until the GPU is
    done: a spin of ``_SPIN_S``, then sleeps doubling up to ``_POLL_MAX_S``. Interruptible
    between polls (and in each sleep, by the interrupter's signal); a hung collective is
    then released by aborting its communicator (the runtime's AbortProcessGroup)."""
    t_spin = time.perf_counter() + _SPIN_S
    delay = 20e-6
    while not work.is_completed():
        interrupter.check()
        if time.perf_counter() < t_spin:
            continue
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)
    try:
        work.wait()  # raises the collective's error, if it failed on the GPU
    except Exception as e:
        interrupter.check()
        raise CollectiveFailed(f"collective failed: {e}") from e


def allreduce(
    pg: dist.ProcessGroup,
    tensors: Sequence[torch.Tensor],
    interrupter: Interrupter,
    op: dist.ReduceOp = dist.ReduceOp.SUM,  # type: ignore[assignment]
) -> None:
    """Sum (or ``op``) ``tensors`` in place across ``pg``; interruptible."""
    interrupter.check()
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    gpu = any(t.is_cuda for t in tensors)
    wait_work(pg.allreduce(list(tensors), opts), interrupter, gpu=gpu)


def broadcast(
    pg: dist.ProcessGroup,
    tensors: Sequence[torch.Tensor],
    src: int,
    interrupter: Interrupter,
) -> None:
    """Broadcast ``tensors`` from group rank ``src`` in place; interruptible."""
    interrupter.check()
    gpu = any(t.is_cuda for t in tensors)
    wait_work(start_broadcast(pg, tensors, src), interrupter, gpu=gpu)


def start_broadcast(pg: dist.ProcessGroup, tensors: Sequence[torch.Tensor], src: int) -> dist.Work:
    """Start a broadcast of ``tensors`` from group rank ``src``, in place, and return its
    work without waiting: :func:`wait_work` it before the tensors are used."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return pg.broadcast(list(tensors), opts)


def broadcast_bytes(
    pg: dist.ProcessGroup,
    data: bytes | None,
    src: int,
    interrupter: Interrupter,
    *,
    device: torch.device | str = "cpu",
    first: int = 64 << 10,
) -> bytes:
    """Broadcast a byte string of any length from group rank ``src`` (which passes it;
    the others pass None) and return it on every rank; interruptible. One collective of
    ``first`` bytes carries the length and as much as fits, a second one the rest only
    when the data is longer: receivers need not learn the size before they can take
    part. ``device``: where the collective's tensors live (the GPU for NCCL)."""
    sending = data is not None
    buf = torch.zeros(first, dtype=torch.uint8)
    if data is not None:
        head = len(data).to_bytes(8, "little") + data[: first - 8]
        buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    wire = buf.to(device)
    broadcast(pg, [wire], src, interrupter)
    got = wire.cpu().numpy().tobytes()
    size = int.from_bytes(got[:8], "little")
    out = data if data is not None else got[8 : 8 + size]
    if size > first - 8:
        rest = (
            torch.frombuffer(bytearray(out[first - 8 :]), dtype=torch.uint8)
            if sending
            else torch.empty(size - (first - 8), dtype=torch.uint8)
        ).to(device)
        broadcast(pg, [rest], src, interrupter)
        if not sending:
            out += rest.cpu().numpy().tobytes()
    return out


def barrier(pg: dist.ProcessGroup, interrupter: Interrupter) -> None:
    """A barrier over ``pg`` (an allreduce of one element: Gloo's barrier is not
    future-backed on every version); interruptible."""
    allreduce(pg, [torch.zeros(1)], interrupter)
