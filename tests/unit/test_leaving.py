"""Leaving safely (issue 48), the parts that need no job: the drain's checkpoint wait."""

from __future__ import annotations

import contextlib
import threading
import time

from fastft.runtime.contract import EpochView, Member, RuntimeConfig
from fastft.runtime.durable.commit import CommitCheckpoints


class _Writer:
    """A checkpoint writer still busy with the last write for ``busy_s``."""

    def __init__(self, busy_s: float) -> None:
        self.until = time.monotonic() + busy_s
        self.failing: list[str] = []
        self.deferred = False
        self.staged: list[int] = []
        self.last_step, self.last_time = 0, 0.0

    @property
    def busy(self) -> bool:
        return time.monotonic() < self.until

    def prepare(self) -> None:
        pass

    def wait(self) -> None:
        time.sleep(max(0.0, self.until - time.monotonic()))

    def save_async(self, step: int, epoch: int, state: dict) -> bool:
        self.staged.append(step)
        self.last_step = step
        return True


class _Events:
    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []

    def emit(self, name: str, **kw: object) -> None:
        self.got.append((name, kw))


def test_a_drains_checkpoint_waits_for_the_writer_alive_and_says_so():
    """A drain forces a checkpoint of its commit; the epoch's first member waits for the
    write still in progress. The wait ran unshielded on the step's thread, the agent took
    it for a hang and killed a healthy rank 0 (issue 48, 2): it is shielded now (the
    heartbeat goes on), and its length is an event."""
    shielded = threading.Event()
    inside: list[bool] = []

    @contextlib.contextmanager
    def shield():
        shielded.set()
        try:
            yield
        finally:
            shielded.clear()

    writer, events = _Writer(busy_s=0.2), _Events()
    wait = writer.wait
    writer.wait = lambda: (inside.append(shielded.is_set()), wait())[1]  # type: ignore[method-assign]
    cc = CommitCheckpoints(
        writer,
        RuntimeConfig(store="127.0.0.1:1", job="j", rank=0, world_size=2),
        events,
        lambda s: {},
        shield,
    )
    me = Member(0, 1)
    view = EpochView(1, (me, Member(1, 2)), 4, needs_state=frozenset(), source=None)
    cc.committed(5, force=True)
    cc.settle(view, me)
    assert inside == [True]  # waited, inside the shield
    assert writer.staged == [5]  # and then wrote the drain's checkpoint
    waits = [kw for name, kw in events.got if name == "checkpoint_wait"]
    assert len(waits) == 1 and waits[0]["wait_ms"] >= 150 and waits[0]["done"], events.got


def test_a_job_end_signals_the_workers_before_it_ends_the_zygote():
    """The zygote's end took ~1 s (a Python with torch finalizing), and the workers
    trained on meanwhile at every job end, Ctrl-C included (issue 48, 4)."""
    import signal

    from fastft.launch.procs.children import Children, Slot
    from fastft.launch.procs.output import Output

    order: list[str] = []
    children = Children(
        on_stopped=lambda *a: None,
        claim=lambda *a: True,
        after_exit=lambda *a: None,
        on_other=lambda *a: None,
        output=Output(None, 3),
    )

    class _Zygote:
        def stop(self) -> None:
            order.append("zygote")

    children.zygote = _Zygote()  # type: ignore[assignment]
    children.kill = lambda slot, sig, incarnation=None: order.append(f"rank {slot.rank}")  # type: ignore[method-assign]
    slots = [Slot(rank=0), Slot(rank=1)]
    children.kill_all(slots, signal.SIGKILL, grace_s=0.0)
    assert order[:3] == ["rank 0", "rank 1", "zygote"]
    assert all(s.done for s in slots)


def test_a_collective_after_a_peers_fault_tore_the_group_down_is_that_fault():
    """tx.allreduce() in a step whose group a peer's death had torn down raised 'no process
    group: collectives run inside ft.transaction()', a second fault that blamed the script
    (issue 53): it is the step's interruption now; outside a fault the error stays."""
    from types import SimpleNamespace

    import pytest

    from fastft.fsm import Phase
    from fastft.interrupt import StepInterrupted
    from fastft.runtime.api import Runtime

    def rt(phase: Phase) -> SimpleNamespace:
        state = SimpleNamespace(phase=phase, epoch=3, step=17)
        dp = SimpleNamespace(pg=None)
        return SimpleNamespace(
            interrupter=SimpleNamespace(check=lambda: None),
            engine=SimpleNamespace(dp=dp, state=state),
        )

    with pytest.raises(StepInterrupted) as e:
        Runtime.require_pg(rt(Phase.HEALING))  # type: ignore[arg-type]
    assert (e.value.epoch, e.value.step) == (3, 17)
    with pytest.raises(RuntimeError, match="no process group"):
        Runtime.require_pg(rt(Phase.NORMAL))  # type: ignore[arg-type]


def test_a_drainer_leaving_from_a_formation_writes_the_state_it_holds():
    """It left with others holding the state; a holder it counted on died next, and a
    total loss restored a checkpoint 27 steps back (the fixed chaos soak, issue 48). Now
    it writes what it holds first (any member), once, and only settled state."""
    writer, events = _Writer(busy_s=0.0), _Events()
    cfg = RuntimeConfig(store="127.0.0.1:1", job="j", rank=2, world_size=4)
    cc = CommitCheckpoints(writer, cfg, events, lambda s: {"step": s})
    cc.leaving(127, 6)
    assert writer.staged == [127]
    why = [kw["why"] for name, kw in events.got if name == "checkpoint_wait"]
    assert why == ["a drainer leaving from a formation writes the state it holds"]
    cc.leaving(127, 6)  # written already
    assert writer.staged == [127]
    cc.committed(128, force=False)  # a commit whose post-commit code has not run yet
    cc.leaving(128, 6)
    assert writer.staged == [127]
    assert CommitCheckpoints(None, cfg, events, lambda s: {}).leaving(128, 6) is None


def test_the_last_holder_with_nobody_to_heal_leaves_once_its_state_is_in_a_checkpoint():
    """Issue 60, case 7: the job preempted (SIGTERM to the agent); ranks 0 and 1 heard the
    drain before step 11's vote, rank 2 after it, so it re-formed alone as the last
    holder and waited out the 30 s grace, though nobody was coming to heal from it (the
    agent drains) and the step's checkpoint could be written. Now it writes it (or finds
    it written) and leaves; with a joiner registered it stays to heal it."""
    from types import SimpleNamespace

    from fastft.runtime.endings import WorkerExit
    from fastft.runtime.engine import plans
    from fastft.runtime.engine.membership import Membership

    def formation(joiners: dict[int, int], writer: _Writer | None) -> tuple[list[str], list]:
        events = _Events()
        cc = CommitCheckpoints(
            writer,  # type: ignore[arg-type]
            RuntimeConfig(store="127.0.0.1:1", job="j", rank=2, world_size=3),
            events,
            lambda s: {},
        )
        me = Member(2, 3)
        prev = EpochView(1, (Member(0, 1), Member(1, 2), me), 11, frozenset(), None)
        m = Membership.__new__(Membership)
        m.x = SimpleNamespace(  # type: ignore[assignment]
            state=SimpleNamespace(want_drain=True, step=12, epoch=1, leaving=frozenset({0, 1})),
            me=me,
            dead=(),
            checkpoints=cc,
            events=events,
            coord=SimpleNamespace(joiners=lambda: joiners),
        )
        try:
            plan = plans.Form(exclude=frozenset({0, 1}), admit=True, holds=True, rewind=None)
            m._drain_from_formation(prev, plan)
        except WorkerExit:
            return [n for n, _ in events.got], getattr(writer, "staged", [])
        return [n for n, _ in events.got] + ["stayed"], getattr(writer, "staged", [])

    class _Saving(_Writer):
        def __init__(self) -> None:
            super().__init__(busy_s=0.0)
            self.written: set[int] = set()

        def has(self, step: int) -> bool:
            return any(s >= step for s in self.written)

        def save_async(self, step: int, epoch: int, state: dict) -> bool:
            self.written.add(step)
            return super().save_async(step, epoch, state)

    names, staged = formation({}, _Saving())
    assert "drain_from_formation" in names and "stayed" not in names and staged == [12]
    names, staged = formation({0: 9}, _Saving())  # a restart to heal: it stays
    assert names == ["drain_held", "stayed"] and staged == []
    names, _ = formation({}, None)  # no durable tier: nothing covers it, it stays
    assert names == ["drain_held", "stayed"]
