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
from fastft.integrations.torchft.manager import _aborts_release_waiters  # noqa: E402
from fastft.protocol import Fault, ProcessExited, Role, Severity  # noqa: E402
from fastft.runtime.contract import ENV  # noqa: E402


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
    assert type(manager_kwargs["pg"]).__name__ == "_BusProcessGroup"


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
    def __init__(self, quorum_id: int, ranks: list[tuple[int, int]]) -> None:
        self.quorum_id = quorum_id
        self.replica_ids = [f"fastft-{r}-{i}/train:uuid" for r, i in ranks]
        self.heal = False
        self.max_step = 0


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
    replica._members = None  # start_quorum: the next quorum is being formed
    replica._on_message(_report(1, 5, 30, 3))
    assert replica.peer_faults == 0  # not yet: it may not be a member of the new quorum
    replica._on_quorum(_Quorum(3, [(0, 1), (1, 5), (2, 7)]))
    assert replica.peer_faults == 1  # it is: this attempt fails now, not at Gloo's timeout

    replica._members = None
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
    assert (2, 7) in replica._dead
    replica._on_message(_exited(1, 5, None, 9))
    assert replica.peer_faults == 1 and replica.errored() is not None


def test_gloo_works_are_wrapped_and_nccl_is_aborted_whatever_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert not _aborts_release_waiters(ProcessGroupGloo())  # Gloo: wrap its works

    class _Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            if not self.name:
                raise NotImplementedError
            return self.name

    assert _aborts_release_waiters(_Named("torchft-nccl"))  # type: ignore[arg-type]
    assert _aborts_release_waiters(_Named("torchft-baby-nccl"))  # type: ignore[arg-type]
    assert not _aborts_release_waiters(_Named(""))  # type: ignore[arg-type]
