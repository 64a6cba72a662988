"""Interrupt delivery in one process: sleeping, busy, Future.wait, atomic sections,
exactly-once, stale interrupts."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastft.interrupt import FutureCancelled, Interrupter, StepInterrupted


@pytest.fixture
def intr():
    it = Interrupter().install()
    it.begin_step(epoch=3, step=7)
    yield it
    it.close()


def later(fn, delay=0.05):
    t = threading.Timer(delay, fn)
    t.name = "fastft-test-timer"
    t.start()
    return t


def test_interrupts_a_sleeping_main_thread(intr):
    t = later(lambda: intr.interrupt("peer 2 died"))
    start = time.monotonic()
    with pytest.raises(StepInterrupted) as info:
        time.sleep(10)
    t.join()
    assert time.monotonic() - start < 2
    assert info.value.step == 7 and info.value.epoch == 3 and "peer 2 died" in str(info.value)


def test_interrupts_a_busy_python_loop(intr):
    t = later(lambda: intr.interrupt("x"))
    with pytest.raises(StepInterrupted):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pass
    t.join()


def test_fails_a_registered_future_that_blocks_in_c(intr):
    fut = torch.futures.Future()
    t = later(lambda: intr.interrupt("x"))
    # The future fails first; the signal may land before or after the wait returns, so
    # the waiter converts FutureCancelled exactly as the interruptible collectives do.
    with pytest.raises(StepInterrupted), intr.pending(fut):
        try:
            fut.wait()
        except FutureCancelled:
            intr.raise_if_interrupted()
    t.join()
    assert intr.aborted


def test_step_interrupted_is_not_swallowed_by_except_exception(intr):
    t = later(lambda: intr.interrupt("x"))
    with pytest.raises(StepInterrupted):
        try:
            time.sleep(10)
        except Exception:  # noqa: BLE001 - what user code does
            pytest.fail("StepInterrupted must not be an Exception")
    t.join()


def test_atomic_section_defers_the_interrupt_to_its_end(intr):
    done = []
    t = later(lambda: intr.interrupt("x"), delay=0.02)
    with pytest.raises(StepInterrupted), intr.atomic():
        time.sleep(0.15)
        done.append("body finished")
    t.join()
    assert done == ["body finished"]


def test_a_deferred_interrupt_lets_the_work_finish_and_raises_at_the_next_check(intr):
    intr.defer_s = 10.0
    done = []
    t = later(lambda: intr.interrupt("x"), delay=0.02)
    time.sleep(0.15)  # not interrupted
    done.append("part finished")
    t.join()
    assert intr.aborted
    with pytest.raises(StepInterrupted):
        intr.check()
    assert done == ["part finished"]
    intr.begin_step(epoch=3, step=8)
    assert intr.defer_s == 0, "each step starts undeferred"


def test_a_deferral_ends_after_its_time_even_without_a_check(intr):
    intr.defer_s = 0.2
    t = later(lambda: intr.interrupt("x"), delay=0.02)
    start = time.monotonic()
    with pytest.raises(StepInterrupted):
        time.sleep(10)
    t.join()
    assert 0.2 <= time.monotonic() - start < 2


def test_exactly_once_whichever_path_wins(intr):
    """Five interrupts, a failed future and a signal: StepInterrupted is raised once."""
    fut = torch.futures.Future()
    raised = []
    t = later(lambda: [intr.interrupt(f"fault {i}") for i in range(5)])
    try:
        try:
            with intr.pending(fut):
                fut.wait()
        except FutureCancelled:
            intr.raise_if_interrupted()  # what wait_work does
    except StepInterrupted as e:
        raised.append(e)
    t.join()
    intr.raise_if_interrupted()  # the token is taken: nothing more is raised
    assert len(raised) == 1 and intr.interrupts == 1 and intr.deliveries == 1
    assert "fault 0" in str(raised[0])


def test_stale_interrupts_are_ignored(intr):
    assert intr.interrupt("old", epoch=2) is False
    assert intr.interrupt("old", step=6) is False
    assert not intr.aborted
    intr.begin_step(3, 8)
    results = []
    t = later(lambda: results.append(intr.interrupt("now", epoch=3, step=8)))
    with pytest.raises(StepInterrupted):
        time.sleep(5)
    t.join()
    assert results == [True]


def test_a_dead_step_refuses_new_work(intr):
    t = later(lambda: intr.interrupt("x"))
    with pytest.raises(StepInterrupted):
        time.sleep(5)
    t.join()
    with pytest.raises(StepInterrupted):
        intr.check()
    intr.begin_step(3, 8)
    intr.check()  # a new step is clean


def test_abort_hooks_run_on_interrupt(intr):
    calls = []
    remove = intr.add_abort_hook(lambda: calls.append("abort"))
    intr.add_abort_hook(lambda: 1 / 0)  # a failing hook does not stop the others
    t = later(lambda: intr.interrupt("x"))
    with pytest.raises(StepInterrupted):
        time.sleep(5)
    t.join()
    assert calls == ["abort"]
    remove()


def test_install_outside_main_thread_is_refused():
    errors = []

    def run():
        try:
            Interrupter().install()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=run, name="fastft-test")
    t.start()
    t.join()
    assert errors


def test_a_disarmed_step_is_not_interrupted(intr):
    intr.end_step()
    assert intr.interrupt("late") is False
    assert not intr.aborted
    time.sleep(0.05)  # no signal may arrive either


def test_shielded_code_is_never_interrupted_by_the_signal(intr):
    def machinery():
        t = later(lambda: intr.interrupt("x"), delay=0.02)
        time.sleep(0.15)  # the signal lands here and must not raise
        t.join()
        return "finished"

    intr.shield(machinery)
    assert machinery() == "finished"
    assert intr.aborted  # the step is still marked aborted: the next check raises
    with pytest.raises(StepInterrupted):
        intr.check()
