"""ManagerFFT without a running torchft (its constructor stubbed): what it passes to
torchft's Manager under ``fastft run`` (its defaults, the user's own settings kept), and how
it decides on a peer's Fault2 report (this attempt of the step, a late report about an
attempt already rolled back, a report that arrives while a quorum forms)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torchft")

from torchft import ProcessGroupGloo  # noqa: E402
from torchft.manager import Manager  # noqa: E402

from fastft.integrations.torchft import ManagerFFT  # noqa: E402
from fastft.integrations.torchft.pg import aborts_release_waiters  # noqa: E402
from fastft.integrations.torchft.replica import QuorumTap  # noqa: E402
from fastft.process.env import WORKER_VARS as ENV  # noqa: E402
from fastft.protocol import (  # noqa: E402
    DrainNotice,
    Fault,
    JoinRequest,
    ProcessExited,
    Role,
    RollbackRequest,
    Severity,
)


class _Stop(Exception):
    pass


@pytest.fixture
def manager_kwargs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_init(self: Manager, pg: Any, *args: Any, **kwargs: Any) -> None:
        seen.update(kwargs, pg=pg)
        raise _Stop

    monkeypatch.setattr(Manager, "__init__", fake_init)
    monkeypatch.setenv(ENV["store"], "127.0.0.1:29400")
    monkeypatch.setenv(ENV["rank"], "2")
    monkeypatch.setenv(ENV["incarnation"], "5")
    monkeypatch.setenv(ENV["job"], "j")
    monkeypatch.setenv(ENV["world_size"], "3")
    return seen


def _construct(**kwargs: Any) -> None:
    with pytest.raises(_Stop):
        ManagerFFT(
            pg=ProcessGroupGloo(),
            min_replica_size=1,
            load_state_dict=None,
            state_dict=None,
            store_addr="127.0.0.1",
            store_port=1,
            rank=0,
            world_size=1,
            **kwargs,
        )


@pytest.mark.timeout(30)
def test_under_fastft_defaults(manager_kwargs: dict[str, Any]) -> None:
    _construct(replica_id="train")
    assert manager_kwargs["replica_id"] == "fastft-2-5/train"
    assert manager_kwargs["hostname"] == "127.0.0.1"  # the job's store is local
    # the bus reports deaths: the lighthouse heartbeat is only a backstop
    assert manager_kwargs["heartbeat_interval"] == timedelta(seconds=1)
    assert type(manager_kwargs["pg"]).__name__ == "BusProcessGroup"


@pytest.mark.timeout(30)
def test_user_settings_are_kept(manager_kwargs: dict[str, Any]) -> None:
    _construct(
        replica_id="train",
        heartbeat_interval=timedelta(milliseconds=200),
        hostname="node7",
    )
    assert manager_kwargs["heartbeat_interval"] == timedelta(milliseconds=200)
    assert manager_kwargs["hostname"] == "node7"


class _Quorum:
    def __init__(
        self, quorum_id: int, ranks: list[tuple[int, int]], at_max_step: int | None = None
    ) -> None:
        self.quorum_id = quorum_id
        self.replica_ids = [f"fastft-{r}-{i}/train:uuid" for r, i in ranks]
        self.heal = False
        self.max_step = 0
        self.replica_world_size = len(ranks)
        self.max_world_size = len(ranks) if at_max_step is None else at_max_step


def _report(rank: int, inc: int, step: int, epoch: int) -> Fault:
    return Fault(
        job="j",
        epoch=epoch,
        rank=rank,
        incarnation=inc,
        step=step,
        severity=Severity.FAULT2,
        cause="reported_error",
        faulty_rank=rank,
        faulty_incarnation=inc,
    )


@pytest.fixture
def replica(monkeypatch: pytest.MonkeyPatch) -> ManagerFFT:
    """Replica rank 0 (incarnation 1) at step 30 of quorum 3, with members 0, 1 and 2."""

    def fake_init(self: Manager, pg: Any, *args: Any, **kwargs: Any) -> None:
        self._pg = pg
        self._client = object()
        self._errored = None
        self._step = 30
        self._quorum_id = 3
        self._quorum_future = None

    monkeypatch.setattr(Manager, "__init__", fake_init)
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)
    m = ManagerFFT(pg=ProcessGroupGloo())
    m.fft_rank, m.fft_incarnation = 0, 1
    m._on_quorum(_Quorum(3, [(0, 1), (1, 5), (2, 7)]))
    return m


MEMBERS = [(0, 1), (1, 5), (2, 7)]


class _Lighthouse:
    """torchft's ManagerClient as the tap sees it: counts the quorums asked for."""

    def __init__(self, quorum: _Quorum) -> None:
        self.quorum = quorum
        self.asked = 0

    def _quorum(self, **kwargs: Any) -> _Quorum:
        self.asked += 1
        return self.quorum


class _Bus:
    closed = False

    def __init__(self) -> None:
        self.config = type("C", (), {"job": "j"})()
        self.sent: list[Any] = []

    def broadcast(self, m: Any) -> Any:
        self.sent.append(m)
        return m


@pytest.fixture
def leasing(replica: ManagerFFT) -> tuple[ManagerFFT, _Lighthouse]:
    """The replica with leases on (every 4th step asks), its lighthouse and a bus."""
    lighthouse = _Lighthouse(_Quorum(3, MEMBERS))
    replica.lease.quorum_every = 4
    replica._client = QuorumTap(lighthouse, replica._reuse_quorum, replica._on_quorum)
    replica.bus = _Bus()  # type: ignore[assignment]
    return replica, lighthouse


def _begin(m: ManagerFFT) -> Any:
    """What start_quorum does here: a new attempt, then torchft's quorum thread asks."""
    m._begin_attempt()
    m._errored = None
    return m._client._quorum(step=m._step)


def _end(m: ManagerFFT, ok: bool | None = None) -> bool:
    """What should_commit does here: commit unless the attempt errored."""
    ok = m.errored() is None if ok is None else ok
    if ok:
        m._step += 1
    m._end_attempt(ok)
    return ok


def _attempt(m: ManagerFFT) -> bool:
    _begin(m)
    return _end(m)


@pytest.mark.timeout(30)
def test_a_committed_quorum_is_reused_and_every_nth_step_asks(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, lighthouse = leasing
    asked = []
    for _ in range(30, 38):  # steps 30..37; 32 and 36 are multiples of quorum_every
        before = lighthouse.asked
        assert _attempt(m)
        asked.append(lighthouse.asked - before)
    # step 30 asks (no lease yet), its commit makes the lease; 32 and 36 ask anyway
    assert asked == [1, 0, 1, 0, 0, 0, 1, 0]
    assert m.quorums_reused == 5
    q = _begin(m)  # a reused quorum: torchft's fields, moved to this step, nobody heals
    assert q.quorum_id == 3 and q.max_step == 38 and not q.heal
    assert q.recover_dst_replica_ranks == [] and q.replica_world_size == 3


@pytest.mark.timeout(30)
def test_a_quorum_in_which_someone_heals_is_not_reused(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, lighthouse = leasing
    lighthouse.quorum = _Quorum(4, MEMBERS, at_max_step=2)  # one member heals in it
    assert _attempt(m) and _attempt(m)
    assert lighthouse.asked == 2
    lighthouse.quorum = _Quorum(4, MEMBERS)  # next step every member is at the max step
    assert _attempt(m) and _attempt(m)
    assert lighthouse.asked == 3


@pytest.mark.timeout(30)
def test_a_member_fault_voids_the_lease_and_a_leased_step_it_makes_impossible(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, lighthouse = leasing
    assert _attempt(m)  # step 30, asked: the lease
    _begin(m)  # step 31 on the lease
    # Member 1 rolled back step 30 after this replica committed it: it will ask the
    # lighthouse for step 30 again, so it is not in this step's collectives.
    m._on_message(_report(1, 5, 30, 3))
    assert m.peer_faults == 1 and not _end(m)
    asked = lighthouse.asked
    assert _attempt(m) and lighthouse.asked == asked + 1  # step 31 again: asks


@pytest.mark.timeout(30)
def test_any_report_voids_a_leased_step_even_a_late_one(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    # A report about an attempt in quorum 2 is late here, but another replica may have
    # heard it before its own lease began and ask the lighthouse for this step: whether a
    # message matters must not depend on what each replica knows when it arrives.
    m, lighthouse = leasing
    assert _attempt(m)
    _begin(m)  # step 31 on the lease of quorum 3
    m._on_message(_report(1, 5, 30, 2))
    assert m.peer_faults == 1 and not _end(m)
    asked = lighthouse.asked
    assert _attempt(m) and lighthouse.asked == asked + 1


@pytest.mark.timeout(30)
def test_a_quorum_asked_before_a_fault_was_told_is_not_leased(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, lighthouse = leasing
    m._begin_attempt()
    assert m._reuse_quorum() is None  # step 30 asks ...
    m._on_message(_report(2, 7, 29, 3))  # ... a fault is told while it waits ...
    m._on_quorum(lighthouse.quorum)  # ... and the quorum may not know of it
    assert _end(m)
    assert _attempt(m) and _attempt(m) and lighthouse.asked == 2  # 31 asks, 32 asks anyway
    assert _attempt(m) and lighthouse.asked == 2  # 33 reuses 32's


@pytest.mark.timeout(30)
def test_a_death_voids_a_leased_step_once_and_a_clean_exit_never(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, lighthouse = leasing
    assert _attempt(m)
    _begin(m)  # step 31 on the lease
    m._on_message(_exited(1, 5, None, 9))
    assert m.peer_faults == 1 and not _end(m)
    lighthouse.quorum = _Quorum(4, [(0, 1), (2, 7)])
    assert _attempt(m) and lighthouse.asked == 2
    _begin(m)  # step 32 asks (every 4th), 33 reuses it ...
    assert _end(m)
    _begin(m)
    m._on_message(_exited(1, 5, None, 9))  # ... and a second report of that death is old
    assert m.peer_faults == 1 and _end(m)
    # A replica that ended its loop cleanly took part in all of its last step.
    _begin(m)
    m._on_message(_exited(2, 7, 0, None))
    assert m.peer_faults == 1 and _end(m)
    asked = lighthouse.asked
    lighthouse.quorum = _Quorum(5, [(0, 1)])
    assert _attempt(m) and lighthouse.asked == asked + 1  # but the lease is over


@pytest.mark.timeout(30)
def test_a_join_ends_the_lease_and_the_next_step_asks(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, lighthouse = leasing
    m.lease.quorum_every = 100
    assert _attempt(m)
    _begin(m)  # step 31 on the lease: the joiner is in none of its collectives
    m._on_message(JoinRequest(job="j", epoch=0, rank=1, incarnation=9, role=Role.MONITOR))
    assert m.peer_faults == 0 and _end(m)
    # Step 32 asks; the joiner heals in that quorum (no lease), then one is leased.
    lighthouse.quorum = _Quorum(5, [(0, 1), (1, 9), (2, 7)], at_max_step=2)
    assert _attempt(m) and lighthouse.asked == 2
    lighthouse.quorum = _Quorum(5, [(0, 1), (1, 9), (2, 7)])
    assert _attempt(m) and _attempt(m) and lighthouse.asked == 3


def _waiting(rank: int, inc: int, step: int) -> RollbackRequest:
    return RollbackRequest(
        job="j", epoch=3, rank=rank, incarnation=inc, step=step, role=Role.MONITOR
    )


@pytest.mark.timeout(30)
def test_a_member_waiting_in_the_lighthouse_voids_a_leased_step_it_is_not_in(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, lighthouse = leasing
    m.lease.quorum_every = 100
    assert _attempt(m)  # step 30 asks: the lease
    # Member 2 heard of a joiner before its step 31 and asked the lighthouse for it;
    # this replica heard later and reused its quorum for 31: that step cannot complete.
    _begin(m)
    m._on_message(_waiting(2, 7, 31))
    assert m.peer_faults == 1 and not _end(m)
    assert _attempt(m) and lighthouse.asked == 2  # the retry asks
    # A member that waits for the *next* step took part in all of this one: it completes,
    # and the next step asks.
    assert _attempt(m) and lighthouse.asked == 2  # 32 on the lease of 31's quorum
    _begin(m)  # 33 on the lease
    m._on_message(_waiting(2, 7, 34))
    assert m.peer_faults == 1 and _end(m)
    assert _attempt(m) and lighthouse.asked == 3
    # An attempt that asked already is unchanged: members ask a moment apart, and the
    # quorum they get is still leased.
    m.lease.lease = None
    m._begin_attempt()
    assert m._reuse_quorum() is None  # 35 asks ...
    m._on_message(_waiting(2, 7, 35))  # ... and the lighthouse says another member waits
    m._on_quorum(lighthouse.quorum)
    assert _end(m) and m.peer_faults == 1
    asked = lighthouse.asked
    assert _attempt(m) and lighthouse.asked == asked  # 36 reuses 35's quorum


@pytest.mark.timeout(30)
def test_a_message_after_torchft_counted_the_commit_does_not_void_that_step(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    """torchft's should_commit counts the commit (``_step`` += 1) before the attempt's
    bookkeeping ends: a member waiting for the next step, or leaving after this one, told
    in between, concerns the next step only (seen in CI: a periodic ask at step 64 voided
    a committed step 63, and every replica rolled back)."""
    m, _ = leasing
    m.lease.quorum_every = 100
    assert _attempt(m)  # the lease
    for leaving in (False, True):
        _begin(m)  # step s on the lease
        m._step += 1  # torchft committed it ...
        s = m._step  # ... and member 2 waits for step s + 1, or left before it
        late = DrainNotice(job="j", epoch=3, rank=2, incarnation=7, step=s) if leaving else None
        m._on_message(late or _waiting(2, 7, s))
        m._end_attempt(True)
        assert m.peer_faults == 0 and m.errored() is None
        m.lease.lease = None
        assert _attempt(m)  # asks again: a new lease


@pytest.mark.timeout(30)
def test_a_member_leaving_voids_only_a_step_it_is_not_in(
    leasing: tuple[ManagerFFT, _Lighthouse],
) -> None:
    m, _ = leasing
    assert _attempt(m)
    _begin(m)  # step 31 on the lease
    # Member 2 committed step 31 too and shut down: it took part in all of this step.
    m._on_message(DrainNotice(job="j", epoch=3, rank=2, incarnation=7, step=32))
    assert m.peer_faults == 0 and _end(m)
    m.lease.lease = m.lease.leased_step = None
    assert _attempt(m)  # asked: the lease of step 32
    _begin(m)  # step 33: member 1 left after step 32, so it is not in this one
    m._on_message(DrainNotice(job="j", epoch=3, rank=1, incarnation=5, step=33))
    assert m.peer_faults == 1 and not _end(m)


@pytest.mark.timeout(30)
def test_a_rollback_no_peer_heard_of_is_told(leasing: tuple[ManagerFFT, _Lighthouse]) -> None:
    m, _ = leasing
    bus: _Bus = m.bus  # type: ignore[assignment]
    assert _attempt(m)
    _begin(m)
    assert not _end(m, ok=False)  # e.g. too few replicas: nothing on the bus yet
    assert [(x.cause, x.step, x.severity) for x in bus.sent] == [
        ("rolled_back", 31, Severity.FAULT2)
    ]
    _begin(m)  # the retry, in a new quorum (a failed commit changes the id)
    m._on_quorum(_Quorum(4, MEMBERS))
    m._on_message(_report(1, 5, 31, 4))  # a peer's fault: every peer heard it already
    assert not _end(m) and len(bus.sent) == 1


def test_quorum_every_must_be_positive() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="quorum_every"):
            ManagerFFT(pg=ProcessGroupGloo(), quorum_every=bad)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_peer_report_fails_this_attempt_of_the_step(replica: ManagerFFT) -> None:
    replica._on_message(_report(1, 5, 29, 3))  # another step: ignored
    assert replica.peer_faults == 0 and replica.errored() is None
    replica._on_message(_report(1, 5, 30, 3))
    assert replica.peer_faults == 1 and replica.errored() is not None


@pytest.mark.timeout(30)
def test_a_late_report_about_a_rolled_back_attempt_is_ignored(replica: ManagerFFT) -> None:
    # Step 30 failed in quorum 2 and was rolled back; it is retried in quorum 3. A report
    # sent from quorum 2 about step 30 arrives late: not about this attempt (seen in a run:
    # the survivor failed its retry while its peer committed).
    replica._rolled_back = (30, 2)
    replica._on_message(_report(2, 7, 30, 2))
    assert replica.peer_faults == 0 and replica.errored() is None
    # A report from a sender that had not yet seen quorum 3 still counts when this
    # replica has not rolled back step 30 in any quorum since.
    replica._rolled_back = (29, 3)
    replica._on_message(_report(2, 7, 30, 2))
    assert replica.peer_faults == 1


@pytest.mark.timeout(30)
def test_a_report_while_the_quorum_forms_is_decided_by_the_quorum(replica: ManagerFFT) -> None:
    replica.lease.members = None  # start_quorum: the next quorum is being formed
    replica._on_message(_report(1, 5, 30, 3))
    assert replica.peer_faults == 0  # not yet: it may not be a member of the new quorum
    replica._on_quorum(_Quorum(3, [(0, 1), (1, 5), (2, 7)]))
    assert replica.peer_faults == 1  # it is: this attempt fails now, not at Gloo's timeout

    replica.lease.members = None
    replica._on_message(_report(1, 5, 30, 3))
    replica._on_quorum(_Quorum(4, [(0, 1), (2, 7)]))  # the reporter is not a member
    assert replica.peer_faults == 1


def _exited(rank: int, inc: int, code: int | None, sig: int | None) -> ProcessExited:
    return ProcessExited(
        job="j",
        epoch=0,
        rank=-1,
        incarnation=0,
        role=Role.AGENT,
        exited_rank=rank,
        exited_incarnation=inc,
        exit_code=code,
        signal=sig,
    )


@pytest.mark.timeout(30)
def test_a_clean_exit_leaves_the_step_alone_and_a_kill_fails_it(replica: ManagerFFT) -> None:
    # A replica that ended its loop committed its last step: its exit is no fault of the
    # step in flight here (seen once exits were reported at once: a slower replica voided
    # its own last step). It is still dead for the next quorum.
    replica._on_message(_exited(2, 7, 0, None))
    assert replica.peer_faults == 0 and replica.errored() is None
    assert (2, 7) in replica.lease.dead
    replica._on_message(_exited(1, 5, None, 9))
    assert replica.peer_faults == 1 and replica.errored() is not None


def test_gloo_works_are_wrapped_and_nccl_is_aborted_whatever_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert not aborts_release_waiters(ProcessGroupGloo())  # Gloo: wrap its works

    class _Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            if not self.name:
                raise NotImplementedError
            return self.name

    assert aborts_release_waiters(_Named("torchft-nccl"))  # type: ignore[arg-type]
    assert aborts_release_waiters(_Named("torchft-baby-nccl"))  # type: ignore[arg-type]
    assert not aborts_release_waiters(_Named(""))  # type: ignore[arg-type]
