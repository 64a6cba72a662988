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
