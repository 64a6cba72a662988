"""The durable tier's files (issue 19): a checkpoint is whole or invisible. Round trip of a
real state, a truncated or altered newest checkpoint passed over for the one before, a
writer killed in the middle of a write, and pruning."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from fastft.runtime.durable.checkpoints import CheckpointError, Checkpoints, due, verify
from fastft.runtime.state.registry import StateRegistry

pytestmark = pytest.mark.timeout(120)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields: object) -> None:
        self.seen.append((event, fields))

    def names(self) -> list[str]:
        return [e for e, _ in self.seen]


class Position:
    """A registered object that is not a tensor (a data position)."""

    def __init__(self) -> None:
        self.index, self.epoch = 0, 0

    def state_dict(self) -> dict:
        return {"index": self.index, "epoch": self.epoch, "order": (3, 1, 2)}

    def load_state_dict(self, s: dict) -> None:
        self.index, self.epoch = s["index"], s["epoch"]
        assert s["order"] == (3, 1, 2)


def _registry(seed: int) -> tuple[StateRegistry, Position]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))
    o = torch.optim.Adam(m.parameters())
    if seed == 0:  # a state with Adam's moments
        m(torch.randn(4, 8)).sum().backward()
        o.step()
    r, pos = StateRegistry(), Position()
    r.register(model=m, optimizer=o, data=pos)
    return r, pos


def _save(c: Checkpoints, r: StateRegistry, step: int) -> None:
    assert c.save_async(step, 1, r.state(step))
    c.close()


def test_a_checkpoint_round_trips_the_whole_state(tmp_path):
    r, pos = _registry(0)
    pos.index, pos.epoch = 77, 2
    ev = Events()
    c = Checkpoints(tmp_path, keep=2, events=ev)
    _save(c, r, 40)
    assert ev.names() == ["checkpoint"]
    saved = c.latest()
    assert saved is not None and saved.step == 40
    fresh, fpos = _registry(1)
    assert fresh.digest(40) != r.digest(40)
    assert fresh.load_state(Checkpoints.load(saved.path)) == 40
    assert fresh.digest(40) == r.digest(40)  # parameters and Adam's moments, bitwise
    assert (fpos.index, fpos.epoch) == (77, 2)


def test_a_truncated_or_altered_checkpoint_is_passed_over_with_an_error(tmp_path, caplog):
    r, _ = _registry(0)
    ev = Events()
    c = Checkpoints(tmp_path, keep=3, events=ev)
    for step in (10, 20, 30):
        _save(c, r, step)
    data = tmp_path / "step-00000030" / "tensors.bin"
    data.write_bytes(data.read_bytes()[:-7])  # truncated
    blob = tmp_path / "step-00000020" / "structure.json"
    raw = bytearray(blob.read_bytes())
    raw[-2] ^= 0xFF  # same size, altered
    blob.write_bytes(bytes(raw))
    with caplog.at_level(logging.ERROR):
        assert c.latest().step == 10  # type: ignore[union-attr]
    assert "unusable" in caplog.text and "bytes, not" in caplog.text and "hash" in caplog.text
    assert [f["step"] for e, f in ev.seen if e == "checkpoint_unusable"] == [30, 20]
    with pytest.raises(CheckpointError, match="bytes, not"):
        verify(tmp_path / "step-00000030")


@pytest.mark.slow  # (the slow tier: make test under its 10 minutes (issue 47's zoo joined it))
def test_only_the_newest_are_kept(tmp_path):
    r, _ = _registry(0)
    c = Checkpoints(tmp_path, keep=2, events=Events())
    for step in (5, 10, 15, 20):
        _save(c, r, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000015", "step-00000020"]


def test_a_write_in_progress_is_skipped_not_waited_for(tmp_path):
    r, _ = _registry(0)
    ev = Events()
    c = Checkpoints(tmp_path, keep=2, events=ev)
    big = {"step": 5, "x": torch.zeros(64 << 20, dtype=torch.uint8)}  # 64 MiB: a while
    assert c.save_async(5, 1, big)
    assert not c.save_async(6, 1, r.state(6))  # the step loop goes on
    c.close()
    assert ev.names() == ["checkpoint_skipped", "checkpoint"]


def test_a_checkpoint_due_while_the_writer_starts_is_written_not_skipped(tmp_path):
    """The writer process imports torch (a second or two): a checkpoint due meanwhile is
    staged at once and handed over when the writer is up. It was skipped, and so were the
    next ones while it started, and every restore went back to the first (issue 36)."""
    r, _ = _registry(0)
    ev = Events()
    c = Checkpoints(tmp_path, keep=2, events=ev)
    c.prepare()  # (the job's start)
    assert c.save_async(2, 1, r.state(2))  # due before the writer is up
    c.close()
    assert ev.names() == ["checkpoint"] and c.skipped == 0
    saved = c.latest()
    assert saved is not None and saved.step == 2


WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from fastft.runtime.durable.checkpoints import Checkpoints
    class E:
        def emit(self, *a, **k): pass
    c = Checkpoints(sys.argv[1], keep=5, events=E())
    # 512 MiB in 64 tensors: the write takes a while on this machine
    state = {"step": 50, "t": [torch.ones(2 << 20, dtype=torch.float32) for _ in range(64)]}
    c.save_async(50, 3, state)
    time.sleep(600)
    """
)


@pytest.mark.slow  # (the slow tier: make test under its 10 minutes (issue 47's zoo joined it))
def test_a_writer_killed_mid_write_leaves_nothing_a_restore_would_pick(tmp_path):
    r, _ = _registry(0)
    c = Checkpoints(tmp_path, keep=5, events=Events())
    _save(c, r, 40)
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not (partial := [f for f in tmp_path.glob(".tmp-step-00000050-*/*")]):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        writer = int(partial[0].parent.name.rsplit("-", 1)[1])  # the writer process
        assert writer != p.pid
        os.kill(writer, signal.SIGKILL)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait(timeout=30)
    assert not (tmp_path / "step-00000050").exists()
    assert c.latest().step == 40  # type: ignore[union-attr]
    _save(c, r, 60)  # the next writer removes the dead one's leftovers
    assert not list(tmp_path.glob(".tmp-*"))


def test_due_by_steps_or_by_time():
    kw = dict(last_step=10, last_time=100.0, now=101.0, every=5, interval_s=0.0)
    assert due(15, **kw) and not due(14, **kw) and not due(10, **kw)
    assert due(11, **dict(kw, every=0, interval_s=1.0))
    assert not due(11, **dict(kw, every=0, interval_s=2.0))
    assert not due(15, **dict(kw, every=0, interval_s=0.0))


def test_a_failed_write_is_an_event_and_a_warning_never_a_fault(tmp_path, caplog):
    r, _ = _registry(0)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    ev = Events()
    c = Checkpoints(blocker / "ckpt", keep=2, events=ev)
    with caplog.at_level(logging.WARNING):
        assert c.save_async(10, 1, r.state(10))  # returns at once, raises nothing
        c.close()
    assert ev.names() == ["checkpoint_failed"]
    assert "checkpoint of step 10 failed" in caplog.text
    assert c.latest() is None


STAGED_THEN_KILLED = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from fastft.runtime.durable.checkpoints import Checkpoints
    class E:
        def emit(self, *a, **k): pass
    c = Checkpoints(sys.argv[1], keep=5, events=E())
    c.prepare()
    state = {"step": 70, "t": [torch.full((1 << 20,), 7.0) for _ in range(16)]}
    c.save_async(70, 3, state)
    time.sleep(0.5)  # the job is in the writer's pipe
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_checkpoint_staged_before_the_worker_dies_is_still_written(tmp_path):
    """The writer is a process of its own: it finishes the write it was handed, then ends
    on its own (its pipe closed); a restore meanwhile waits for it."""
    p = subprocess.run([sys.executable, "-c", STAGED_THEN_KILLED, str(tmp_path)], timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".tmp-step-00000070-*"))  # (still importing or writing)
    ev = Events()
    saved = Checkpoints(tmp_path, keep=5, events=ev).latest()  # waits for the live writer
    assert saved is not None and saved.step == 70
    assert ev.names() == ["checkpoint_wait"]
    state = Checkpoints.load(saved.path)
    assert state["step"] == 70 and all(bool((t == 7.0).all()) for t in state["t"])
    assert not list(tmp_path.glob(".tmp-*"))


def test_after_its_writer_process_died_the_next_checkpoint_starts_another(tmp_path):
    ev = Events()
    c = Checkpoints(tmp_path, keep=5, events=ev)
    big = {"step": 5, "t": [torch.ones(2 << 20) for _ in range(64)]}  # 512 MiB: a while
    assert c.save_async(5, 1, big)
    deadline = time.monotonic() + 60
    while not (partial := list(tmp_path.glob(".tmp-step-00000005-*/*"))):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(int(partial[0].parent.name.rsplit("-", 1)[1]), signal.SIGKILL)
    c.wait()
    assert ev.names() == ["checkpoint_failed"]  # an event, never a training fault
    r, _ = _registry(0)
    assert c.save_async(6, 1, r.state(6))
    c.close()
    assert ev.names() == ["checkpoint_failed", "checkpoint"], ev.seen
    assert c.latest().step == 6  # type: ignore[union-attr]


def test_without_room_in_shared_memory_it_writes_in_process(tmp_path, monkeypatch, caplog):
    """A state larger than /dev/shm (64 MB in a default container) must not crash the
    worker with a SIGBUS in the staging copy: the write runs in the worker instead."""

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    shm = set(os.listdir("/dev/shm"))
    ev = Events()
    c = Checkpoints(tmp_path, keep=2, events=ev)
    c.prepare()  # a writer process already started is ended, not left waiting
    c.wait()
    r, _ = _registry(0)
    with caplog.at_level(logging.WARNING):
        assert c.save_async(3, 1, r.state(3))
        c.close()
    assert ev.names() == ["checkpoint"] and "writing in-process" in caplog.text
    assert c.latest().step == 3  # type: ignore[union-attr]
    assert not set(os.listdir("/dev/shm")) - shm  # the buffer it could not fill is gone


def test_a_process_forked_from_the_worker_does_not_keep_the_writer_alive(tmp_path):
    """A data loader's worker processes are forked from the worker and inherit the
    writer's pipe: the writer must still end when the worker closes (it is told)."""
    import multiprocessing as mp

    c = Checkpoints(tmp_path, keep=2, events=Events())
    r, _ = _registry(0)
    assert c.save_async(3, 1, r.state(3))
    c.wait()
    child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()  # holds a copy of every descriptor, the writer's pipe included
    try:
        t0 = time.monotonic()
        c.close(timeout_s=20.0)
        assert time.monotonic() - t0 < 10.0
    finally:
        child.kill()
        child.join(10)
    assert c.latest().step == 3  # type: ignore[union-attr]


def test_a_buffer_left_by_a_job_killed_whole_is_removed_by_the_next(tmp_path):
    """A worker and its writer both killed before the writer mapped the buffer leave it in
    /dev/shm (gigabytes for a real model): the next buffer made on the host removes it."""
    from fastft.runtime.durable.writer import SharedBuffer

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    left = os.path.join(shm, f"fastft-ckpt-{gone.pid}-left")
    mine = os.path.join(shm, f"fastft-ckpt-{os.getpid()}-mine")
    for p in (left, mine):
        open(p, "wb").close()
    try:
        b = SharedBuffer(4096)
        b.unlink()
        assert not os.path.exists(left) and os.path.exists(mine)
    finally:
        for p in (left, mine):
            if os.path.exists(p):
                os.unlink(p)


def test_a_write_in_progress_on_another_host_is_left_alone_until_stale(tmp_path):
    """A shared checkpoint directory: another node's writer cannot be told alive from
    here, so its directory is neither removed (until a day untouched) nor waited for."""
    other = tmp_path / ".tmp-step-00000050-another-host-1"
    other.mkdir(parents=True)
    r, _ = _registry(0)
    c = Checkpoints(tmp_path, keep=2, events=Events())
    t0 = time.monotonic()
    assert c.latest() is None and time.monotonic() - t0 < 5  # not waited for
    _save(c, r, 40)  # prunes
    assert other.exists()
    os.utime(other, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    _save(c, r, 45)
    assert not other.exists()
