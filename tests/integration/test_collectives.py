"""broadcast_bytes: a byte string of any length in one collective when it fits, two when
it does not, with receivers that do not know its size in advance; and the wait for a GPU
work (NCCL), which must last until the GPU finished it and stay interruptible."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fastft.bus import host_store
from fastft.interrupt import Interrupter, broadcast_bytes, wait_work
from fastft.interrupt.contract import CollectiveFailed, StepInterrupted

pytestmark = pytest.mark.timeout(60)


def _run(payload: bytes, first: int, src: int = 1, world: int = 3) -> list[bytes | None]:
    server = host_store()
    out: list[bytes | None] = [None] * world

    def rank(r: int) -> None:
        store = dist.PrefixStore(
            f"t{first}-{len(payload)}",
            dist.TCPStore(
                "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=20)
            ),
        )
        pg = dist.ProcessGroupGloo(store, r, world, datetime.timedelta(seconds=20))
        out[r] = broadcast_bytes(pg, payload if r == src else None, src, Interrupter(), first=first)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    return out


@pytest.mark.parametrize(
    "size, first",
    [(0, 64), (10, 64), (56, 64), (57, 64), (1000, 64), (70_000, 64 << 10)],
)
def test_every_rank_gets_the_bytes(size: int, first: int) -> None:
    payload = bytes((i * 7 + 3) % 256 for i in range(size))
    assert _run(payload, first) == [payload] * 3


# --- GPU works: wait for the GPU, not for the enqueue (NCCL), interruptibly ---------------


class _GpuLikeWork:
    """A work whose future is done at once, as NCCL's is when the collective is enqueued,
    and which finishes ``after_s`` later (or never), as its end event would."""

    def __init__(self, after_s: float | None, error: Exception | None = None) -> None:
        self._done_at = None if after_s is None else time.monotonic() + after_s
        self._error = error
        self.polls = 0

    def get_future(self) -> torch.futures.Future:
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(None)
        return f

    def is_completed(self) -> bool:
        self.polls += 1
        return self._done_at is not None and time.monotonic() >= self._done_at

    def wait(self) -> bool:
        if self._error is not None:
            raise self._error
        return True


def test_a_gpu_work_is_waited_for_until_the_gpu_finishes_it() -> None:
    work = _GpuLikeWork(after_s=0.05)
    t0 = time.monotonic()
    wait_work(work, Interrupter(), gpu=True)  # type: ignore[arg-type]
    waited = time.monotonic() - t0
    assert work.is_completed() and waited >= 0.05
    assert waited < 0.05 + 0.25  # noticed within the poll interval (loose: a loaded machine)


class _CpuLikeWork(_GpuLikeWork):
    """A Gloo work: ``wait(timeout)`` blocks until it completes, or raises as torch's
    ``Work.wait`` does when the timeout runs out first (the work left as it was)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        left = None if self._done_at is None else self._done_at - time.monotonic()
        if timeout is not None and (left is None or left > timeout.total_seconds()):
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        if left is None:
            raise AssertionError("waited without a timeout on a work that never finishes")
        time.sleep(max(0.0, left))
        return super().wait()


def test_a_cpu_work_is_waited_for_in_slices_and_its_error_is_a_collective_failure() -> None:
    work = _CpuLikeWork(after_s=0.03)
    wait_work(work, Interrupter())  # type: ignore[arg-type]
    assert work.is_completed()
    failed = _CpuLikeWork(after_s=0.01, error=RuntimeError("Connection closed by peer"))
    with pytest.raises(CollectiveFailed, match="Connection closed by peer"):
        wait_work(failed, Interrupter())  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_an_interrupt_ends_the_wait_for_a_work_that_never_finishes(gpu: bool) -> None:
    it = Interrupter().install()
    try:
        it.begin_step(1, 7)
        timer = threading.Timer(0.05, it.interrupt, ("peer 2 died",))
        timer.start()
        t0 = time.monotonic()
        work = (_GpuLikeWork if gpu else _CpuLikeWork)(after_s=None)
        with pytest.raises(StepInterrupted, match="peer 2 died"):
            wait_work(work, it, gpu=gpu)  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 5  # (released, not left to a timeout)
        timer.join()
    finally:
        it.close()


def test_a_gpu_work_that_failed_on_the_gpu_is_a_collective_failure() -> None:
    work = _GpuLikeWork(after_s=0.0, error=RuntimeError("NCCL error: remote process exited"))
    with pytest.raises(CollectiveFailed, match="remote process exited"):
        wait_work(work, Interrupter(), gpu=True)  # type: ignore[arg-type]
