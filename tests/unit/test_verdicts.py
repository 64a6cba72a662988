"""The agent's hang verdicts. At the job's end: once a member marked the job finished (it
closed after the last step), a worker still in that step holds up no peer, so its pace
proves no hang (a busy machine: found by CI, where a worker killed 0.6 s into its last
step never ran the script's code after the loop); only ``--hang-timeout`` ends it. On a
busy machine: the time a worker was kept off the CPU is no silence of its own."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import fastft.launch.gray.verdicts as verdicts
from fastft.launch.gray.verdicts import Verdicts
from fastft.process.beat import BEAT_FORMAT, Beat, Wait


def _beat(path: Path, *, last: float, pace: float, **more: Any) -> None:
    b = Beat(last=last, pace=pace, between=0.0, commits=20.0, compute=pace, **more)
    path.write_bytes(struct.pack(BEAT_FORMAT, *b))


@dataclass
class _Store:
    keys: dict[str, bytes] = field(default_factory=dict)
    asked: int = 0

    def check(self, keys: list[str]) -> bool:
        self.asked += 1
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]


@dataclass
class _Agent:
    heartbeat: Path
    hang_timeout_s: float = 30.0
    store: _Store = field(default_factory=_Store)
    published: list[Any] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    hung: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = SimpleNamespace(
            hang_timeout_s=self.hang_timeout_s,
            hang_pace=True,
            start_grace_s=5.0,
            between_steps_timeout_s=600.0,
            job="j",
        )
        self.keys = SimpleNamespace(finished="finished")
        self.nodes = SimpleNamespace(store_gone=False)
        self.header = dict(job="j", epoch=0, rank=-1, incarnation=0)
        self.events = SimpleNamespace(emit=lambda name, **f: self.hung.append(f))
        self.children = SimpleNamespace(kill=lambda slot, *a, **k: self.killed.append(slot.rank))
        self.slots: dict[int, Any] = {}

    def publish(self, m: Any) -> None:
        self.published.append(m)


def _slot(agent: _Agent, started: float) -> SimpleNamespace:
    return SimpleNamespace(
        rank=2, life=1, incarnation=7, done=False, hung=0, started=started,
        heartbeat=str(agent.heartbeat), proc=SimpleNamespace(pid=123456789, returncode=None),
    )  # fmt: skip


@pytest.fixture
def agent(tmp_path: Path, monkeypatch) -> _Agent:
    monkeypatch.setattr(verdicts, "await_signal_taken", lambda pid, sig: None)  # (no process)
    return _Agent(tmp_path / "hb")


def test_a_slow_step_is_hung_by_its_pace_while_the_job_goes_on(agent):
    now = time.monotonic()
    _beat(agent.heartbeat, last=now - 0.8, pace=0.05)  # 0.8 s silent; 10x its pace: 0.5 s
    Verdicts(agent).check_hang(_slot(agent, now - 10), now)  # type: ignore[arg-type]
    assert agent.killed == [2, 2]  # its stacks, then the kill
    assert agent.hung[0]["timeout_s"] == 0.5 and len(agent.published) == 1
    assert agent.store.asked == 1


def test_once_the_job_finished_only_the_hang_timeout_ends_a_slow_last_step(agent):
    now = time.monotonic()
    agent.store.keys["finished"] = b"30"
    _beat(agent.heartbeat, last=now - 0.8, pace=0.05)
    slot = _slot(agent, now - 10)
    v = Verdicts(agent)
    v.check_hang(slot, now)  # type: ignore[arg-type]
    assert agent.killed == [] and agent.published == [] and v.job_done
    v.check_hang(slot, now + 1)  # type: ignore[arg-type]
    assert agent.killed == [] and agent.store.asked == 1  # (a finished job stays finished)
    v.check_hang(slot, now + agent.hang_timeout_s)  # 30.8 s silent: hung all the same
    assert agent.killed == [2, 2] and agent.hung[0]["timeout_s"] == agent.hang_timeout_s


def test_a_store_that_does_not_answer_leaves_the_paced_verdict(agent):
    now = time.monotonic()
    agent.nodes.store_gone = True  # (a call to it would never return)
    _beat(agent.heartbeat, last=now - 0.8, pace=0.05)
    Verdicts(agent).check_hang(_slot(agent, now - 10), now)  # type: ignore[arg-type]
    assert agent.killed == [2, 2] and agent.store.asked == 0


def test_the_line_names_the_members_that_waited_on_the_hung_one(agent, tmp_path):
    """Issue 60: the holder waits in a heal on the restart that hangs; the restart's
    verdict names it (and the holder's own heartbeat says whom it waits on)."""
    now = time.monotonic()
    _beat(agent.heartbeat, last=now - 0.8, pace=0.05)
    hung = agent.slots[2] = _slot(agent, now - 10)
    holder = tmp_path / "hb0"  # waiting since 0.9 s on rank 2 life 7 (Wait.PEER)
    _beat(holder, last=now, pace=0.05, waiting=now - 0.9, waits=float(Wait.PEER),
          on_rank=2.0, on_incarnation=7)  # fmt: skip
    agent.slots[0] = SimpleNamespace(rank=0, life=0, incarnation=5, done=False,
                                     heartbeat=str(holder))  # fmt: skip
    Verdicts(agent).check_hang(hung, now)  # type: ignore[arg-type]
    assert agent.killed == [2, 2] and agent.hung[0]["waiters"] == [0]


def test_a_declared_death_kills_the_life_it_names_never_a_newer_one(agent):
    """Issue 60, case 3: node 2 cut off for 20 s was declared lost (its life 0); its
    agent started life 1 once the store answered, and the verdict, reaching it 6.5 s
    later, killed that new, healthy life (the check compared the message's life with
    itself)."""
    from fastft.protocol import Fault, Role, Severity

    now = time.monotonic()
    slot = agent.slots[2] = _slot(agent, now - 10)  # life 1, incarnation 7

    def declared(inc: int, role: Role = Role.AGENT) -> Fault:
        return Fault(job="j", epoch=0, rank=-1, incarnation=0, role=role,
                     severity=Severity.FAULT1, cause="node 2 lost (lease not renewed)",
                     faulty_rank=2, faulty_incarnation=inc)  # fmt: skip

    v = Verdicts(agent)
    v.on_message(declared(5))  # life 0's verdict, late
    assert agent.killed == [] and agent.hung[-1]["live"] == 7
    v.on_message(declared(7))  # the life it names: killed
    assert agent.killed == [2] and slot.declared[0] == 7
    v.on_message(declared(0, Role.MONITOR))  # an outside monitor names no life: the live one
    assert agent.killed == [2, 2]


def _pinned(code: str, cpu: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code])
    os.sched_setaffinity(p.pid, {cpu})
    return p


@pytest.mark.timeout(60)
@pytest.mark.parametrize("starved", [True, False])
def test_a_worker_the_machine_does_not_run_is_not_hung_by_its_pace(agent, starved):
    """CI, a Ray job on 2 cores: rank 3's GIL holder waited 0.38 s of 0.7 s for a core
    after a peer's SIGKILL; silent 0.5 s in its commit, it was killed by its 0.5 s pace,
    a second fault of a job that had one. Kept off the CPU, only the rest of its silence
    counts; asleep in a step (a real hang) it is hung on time."""
    cpu = min(os.sched_getaffinity(0))
    code = "while True: pass" if starved else "import time; time.sleep(30)"
    worker = _pinned(code, cpu)
    others = [_pinned("while True: pass", cpu) for _ in range(3 if starved else 0)]
    try:
        time.sleep(0.3)
        now = time.monotonic()
        _beat(agent.heartbeat, last=now - 0.3, pace=0.05)  # its limit: 0.5 s
        slot = _slot(agent, now - 10)
        slot.proc = SimpleNamespace(pid=worker.pid, returncode=None)
        v = Verdicts(agent)
        v.check_hang(slot, now)  # type: ignore[arg-type]  # past half: its waits are read
        time.sleep(0.4)
        v.check_hang(slot, time.monotonic())  # type: ignore[arg-type]  # 0.7 s silent
    finally:
        for p in [worker, *others]:
            p.kill()
            p.wait(timeout=10)
    if starved:  # (4 busy on one core: it ran ~1/4 of the 0.4 s)
        assert agent.killed == [] and agent.published == []
        (deferred,) = agent.hung
        assert deferred["kept_off"] > 0.5 and deferred["timeout_s"] == 0.5
    else:
        assert agent.killed == [2, 2] and agent.hung[0]["timeout_s"] == 0.5
