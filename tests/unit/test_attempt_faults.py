"""What a step's exception means to a member of a shard group (``--shard-size``). Its own
exception ends it (its group mates may be inside an FSDP collective with it, which Gloo
cannot abort: the agent restarts the group). A collective of fastft's own that failed (a
peer's connection closed: its death, the notice on the way) is no fault of the group: the
member entered every collective of its group and lives on, so the step rolls back (a
cross-node loop found rank 1 restarting its healthy group, and the job lost every holder
of its state)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import fastft.runtime.attempt as attempt
from fastft.interrupt import CollectiveFailed
from fastft.protocol.exits import EXIT_GROUP_FAULT
from fastft.runtime.attempt import StepAttempts


class _GroupEnded(Exception):
    pass


def _runtime(faults: list[Any]) -> Any:
    engine = SimpleNamespace(
        dp=SimpleNamespace(heal_tail=None),
        phase_changes=0,
        local_fault=lambda e, gen=None: faults.append(e),
    )
    return SimpleNamespace(
        engine=engine,
        sharded=True,
        rank=1,
        step=8,
        config=SimpleNamespace(max_step_retries=3),
        interrupter=SimpleNamespace(end_step=lambda: None),
        heartbeat=SimpleNamespace(beat=lambda: None),
        events=SimpleNamespace(emit=lambda *a, **k: None, close=lambda: None),
    )


@pytest.fixture
def ended(monkeypatch) -> list[tuple[int, str]]:
    got: list[tuple[int, str]] = []

    def exit_now(status: int, why: str) -> None:
        got.append((status, why))
        raise _GroupEnded  # (the real one ends the process)

    monkeypatch.setattr(attempt, "exit_now", exit_now)
    return got


def test_a_failed_collective_rolls_the_step_back_and_the_member_lives(ended):
    faults: list[Any] = []
    a = StepAttempts(_runtime(faults))
    e = CollectiveFailed("collective failed: Connection closed by peer")
    assert a.exit(SimpleNamespace(step=8), CollectiveFailed, e) is True  # (handled: retried)
    assert faults == [e] and ended == []


def test_the_scripts_own_exception_ends_the_member_and_its_group_restarts(ended):
    faults: list[Any] = []
    a = StepAttempts(_runtime(faults))
    with pytest.raises(_GroupEnded):
        a.exit(SimpleNamespace(step=8), ValueError, ValueError("the script's own"))
    assert [s for s, _ in ended] == [EXIT_GROUP_FAULT] and faults == []


class _Engine:
    """An engine whose machine a peer's fault moves on while the step is being set up."""

    def __init__(self) -> None:
        self.state = SimpleNamespace(phase=attempt.Phase.NORMAL, epoch=1, step=7)
        self.view = SimpleNamespace(index=lambda rank: 0, members=(0, 1))
        self.phase_changes = 4
        self.kept = SimpleNamespace(begin_attempt=lambda: None)
        self.dp = SimpleNamespace(gate=None)

    def seen(self) -> Any:
        return SimpleNamespace(state=self.state, view=self.view, phase_changes=self.phase_changes)

    def peer_fault(self) -> None:
        self.state = SimpleNamespace(phase=attempt.Phase.HEALING, epoch=1, step=7)
        self.phase_changes += 1


def _entering(
    fault_in_window: bool, sharded: bool = False
) -> tuple[StepAttempts, list[tuple[str, int, int]]]:
    x = _Engine()
    interrupts: list[tuple[str, int, int]] = []
    armed: list[tuple[int, int]] = []

    def begin_step() -> None:  # (the registry's begin of a step: the window)
        if fault_in_window:
            x.peer_fault()

    def interrupt(reason: str, *, epoch: int, step: int) -> bool:
        assert armed == [(epoch, step)]  # (armed first: else the interrupt is dropped)
        assert deferred or not sharded  # (a shard group's mates run the body first)
        interrupts.append((reason, epoch, step))
        return True

    deferred: list[float] = []

    rt = SimpleNamespace(
        registered=True,
        engine=x,
        sharded=sharded,
        rank=0,
        config=SimpleNamespace(reseed=False, compare_every=0, rollback_timeout_s=10.0),
        registry=SimpleNamespace(
            check_schedulers=lambda: None,
            begin_step=begin_step,
            verified=SimpleNamespace(step=None),
        ),
        heartbeat=SimpleNamespace(between=lambda waiting: None, beat=lambda: None),
        interrupter=SimpleNamespace(
            begin_step=lambda epoch, step: armed.append((epoch, step)),
            interrupt=interrupt,
            defer=deferred.append,
        ),
        injector=SimpleNamespace(fire_due=lambda step: None),
    )
    a = StepAttempts(rt)
    a._begin_attempt = lambda: True  # type: ignore[method-assign]
    a.gate_gen = x.phase_changes  # (crossed the gate before the fault)
    a.agreement.begin = lambda epoch, step, world: False  # type: ignore[method-assign]
    return a, interrupts


def test_a_fault_as_the_step_is_set_up_interrupts_it_and_its_failures_are_that_faults():
    """A peer's fault landing after the attempt saw NORMAL and before its step was armed
    (seen in a Ray run: rank 0's step then failed on the dead peer's reset connection, was
    reported as its own fault and cost a second rollback cycle): the step is interrupted
    once armed, and the attempt's generation is the one before the fault, so its failures
    are superseded (a consequence of the fault already handled)."""
    a, interrupts = _entering(fault_in_window=True)
    tx = a.enter(SimpleNamespace())
    assert (tx.step, tx.epoch) == (7, 1)
    assert interrupts == [("a fault as the step began", 1, 7)]
    assert a.step_gen == 4  # (before the fault: a failure of this attempt is superseded)


def test_a_step_set_up_without_a_fault_is_not_interrupted():
    a, interrupts = _entering(fault_in_window=False)
    a.enter(SimpleNamespace())
    assert interrupts == [] and a.step_gen == 4


def test_a_shard_groups_member_is_interrupted_after_its_deferral():
    """The same fault in the window of a shard group's member: interrupted only once its
    interrupts are deferred (its mates run the body's FSDP collectives with it)."""
    a, interrupts = _entering(fault_in_window=True, sharded=True)
    a.enter(SimpleNamespace())
    assert interrupts == [("a fault as the step began", 1, 7)] and a.step_gen == 4
