"""The engine's core, stepped one action at a time against a recording port: the same core
the executor runs on threads and the simulator in slices (no threads, no store, no bus)."""

from __future__ import annotations

from fastft.fsm import (
    CastVote,
    CommitApplied,
    Decision,
    DeclareDead,
    DrainRequested,
    FormEpoch,
    GradsReady,
    HealDone,
    PeerFault,
    Phase,
    ZeroGrads,
)
from fastft.protocol import (
    DrainAck,
    DrainNotice,
    Fault,
    ProcessExited,
    RollbackRequest,
    Severity,
)
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.core import JOIN, Core, Wait
from fastft.testing.engine import RecordingPort

ME, PEER, THIRD = Member(0, 1), Member(1, 2), Member(2, 3)
NEVER = lambda s: False  # noqa: E731 - a drive that never returns to the script
AT_NORMAL = lambda s: s.phase is Phase.NORMAL  # noqa: E731


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _core(clock: Clock | None = None) -> Core:
    return Core(ME, "job", rollback_timeout_s=5.0, world_size=3, clock=clock or Clock(), dead=set())


def _view(epoch: int, *members: Member, step: int = 0) -> EpochView:
    return EpochView(epoch, tuple(members), step, frozenset(), None)


def _running(port: RecordingPort, clock: Clock | None = None) -> Core:
    """A core in epoch 1 (ME, PEER, THIRD), its process group built."""
    core = _core(clock)
    assert core.next(AT_NORMAL, port) is JOIN
    assert Core.run(JOIN, port) == "join"
    core.adopt(_view(1, ME, PEER, THIRD), None, port)
    assert Core.run(core.next(NEVER, port), port) == "configure"
    assert core.next(AT_NORMAL, port) is Wait.DONE
    port.take()
    return core


def test_a_fault_free_step_runs_vote_then_commit_then_returns():
    port = RecordingPort()
    core = _running(port)
    core.feed(GradsReady(agreed=False), port)
    a = core.next(NEVER, port)
    assert isinstance(a, CastVote) and (a.epoch, a.step) == (1, 0)
    assert Core.run(a, port) == "vote"
    assert core.next(NEVER, port) is Wait.IDLE  # (the decision is not in yet)
    core.feed(Decision(commit=True), port)
    assert Core.run(core.next(NEVER, port), port) == "commit"
    core.feed(CommitApplied(), port)
    assert core.next(AT_NORMAL, port) is Wait.DONE
    assert core.state.step == 1
    assert port.take() == [("vote", 1, 0), ("commit", 0)]


def test_a_late_collective_commit_is_voted_for_confirmation_and_a_rollback_held_undoes_it():
    port = RecordingPort()
    core = _running(port)
    core.feed(GradsReady(agreed=True, confirm=True), port)
    a = core.next(NEVER, port)
    assert isinstance(a, CastVote) and a.agreed and a.confirm  # (membership confirms it)
    assert Core.run(a, port) == "vote"
    core.feed(Decision(commit=False), port)  # (a rollback proposed first held)
    assert core.state.phase is not Phase.COMMIT and core.state.step == 0


def test_a_peer_fault_interrupts_and_proposes_at_once_then_rolls_back_on_the_main_thread():
    port = RecordingPort()
    core = _running(port)
    core.feed(GradsReady(agreed=False), port)
    Core.run(core.next(NEVER, port), port)  # the vote
    port.take()
    core.feed(PeerFault(PEER.rank, Severity.FAULT2, "boom"), port)
    # the immediate actions ran on the feeding thread, in the machine's order
    assert port.take() == [("interrupt", 1, 0), ("propose_rollback", 1, 0)]
    core.feed(Decision(commit=False), port)
    ran = []
    while isinstance(a := core.next(NEVER, port), ZeroGrads | FormEpoch):
        ran.append(Core.run(a, port))
    assert ran == ["zero_grads", "form"]
    assert core.state.phase is Phase.HEALING
    # the next epoch without the faulty member: the core enters it and builds its group
    core.adopt(_view(2, ME, THIRD), None, port)
    assert Core.run(core.next(NEVER, port), port) == "configure"


def test_queued_actions_of_an_epoch_already_left_are_dropped():
    port = RecordingPort()
    core = _running(port)
    core.feed(PeerFault(PEER.rank, Severity.FAULT1, "dead"), port)
    core.feed(Decision(commit=False), port)
    assert [type(a) for _, _, a in core.todo] == [ZeroGrads, FormEpoch]
    port.take()
    # before the main thread gets to them, the epoch is re-formed (a peer closed it with
    # this member in it): the rollback and the formation of epoch 1 are stale
    core.adopt(_view(2, ME, THIRD), None, port)
    a = core.next(NEVER, port)
    assert Core.run(a, port) == "configure"
    assert not core.todo and port.take() == [("configure", 2)]


def test_a_rollback_message_of_an_epoch_not_adopted_yet_is_kept_until_it_is():
    port = RecordingPort()
    core = _running(port)
    early = RollbackRequest(job="job", epoch=2, rank=2, incarnation=3, step=0, reason="x")
    assert core.receive(early, port) is None
    assert list(core.early) == [early] and core.state.phase is Phase.NORMAL
    core.feed(PeerFault(PEER.rank, Severity.FAULT1, "dead"), port)
    core.feed(Decision(commit=False), port)
    while isinstance(a := core.next(NEVER, port), ZeroGrads | FormEpoch):
        Core.run(a, port)
    port.take()
    core.adopt(_view(2, ME, THIRD), None, port)
    assert not core.early
    # entering epoch 2, the kept request rolls it back at once
    assert ("propose_rollback", 2, 0) in port.take()


def test_declaring_silent_members_dead_broadcasts_their_faults_and_records_their_lives():
    port = RecordingPort()
    core = _running(port)
    core.perform(DeclareDead(frozenset({1, 2})), port)
    assert port.take()[:2] == [("declared_dead", PEER, 1), ("broadcast", "Fault")]
    assert core.dead == {PEER, THIRD}
    faults = [m for m in port.sent if isinstance(m, Fault)]
    assert [(f.faulty_rank, f.faulty_incarnation, f.severity) for f in faults] == [
        (1, 2, Severity.FAULT1),
        (2, 3, Severity.FAULT1),
    ]


def test_a_drain_wait_past_its_deadline_feeds_the_deadline_and_looks_again():
    clock = Clock()
    port = RecordingPort()
    core = _running(port, clock)
    core.feed(DrainRequested(), port)
    core.feed(GradsReady(agreed=False), port)
    Core.run(core.next(NEVER, port), port)  # the vote, with want_drain
    core.feed(Decision(commit=True, leaving=frozenset({ME.rank})), port)
    Core.run(core.next(NEVER, port), port)  # the commit
    core.feed(CommitApplied(), port)
    assert core.state.phase is Phase.DRAIN_WAIT, core.state.phase
    assert core.next(NEVER, port) is Wait.IDLE
    clock.now += 5.1
    assert core.next(NEVER, port) is Wait.AGAIN
    assert port.transitions[-1][0] == "Deadline"


def test_a_drain_ack_for_a_leaver_of_an_epoch_already_left_is_returned_to_send():
    port = RecordingPort()
    core = _running(port)
    core.feed(PeerFault(PEER.rank, Severity.FAULT1, "dead"), port)
    core.feed(Decision(commit=False), port)
    core.adopt(_view(2, ME, THIRD), None, port)
    port.take()
    # rank 1 left epoch 1 by a drain; its notice arrives after epoch 2 began without it
    late = DrainNotice(job="job", epoch=1, rank=1, incarnation=2, step=0, reason="drain")
    ack = core.receive(late, port)
    assert isinstance(ack, DrainAck) and ack.drained_rank == 1 and ack.epoch == 2
    assert port.take() == [("record", "drain_ack_late")]


def test_an_event_the_machine_has_no_row_for_is_reported_not_applied():
    port = RecordingPort()
    core = _core()
    before = core.state
    core.feed(HealDone(), port)  # (INIT: nothing to heal)
    assert port.names() == ["invalid"] and core.state == before


def test_a_worker_re_forming_when_its_peers_finish_the_job_ends_instead_of_waiting():
    """Found by the simulator (3 members, elastic, 1 step, 2 faults): a member lost its
    state as its peers committed the last step; it re-formed with a restarted peer that
    saw the job finished and left; it then waited for that peer's process group forever."""
    port = RecordingPort(finished=True)
    core = _running(port)
    core.feed(PeerFault(PEER.rank, Severity.FAULT1, "dead"), port)
    core.feed(Decision(commit=False), port)
    assert core.state.phase is Phase.HEALING
    done = ProcessExited(
        job="job", epoch=1, rank=-1, incarnation=7, step=1, exited_rank=2, exited_incarnation=3,
        exit_code=0,
    )  # fmt: skip
    core.receive(done, port)
    assert core.next(NEVER, port) is Wait.FINISHED and not core.todo
    # a member at the last step's commit is not ended by it: it finishes the job itself
    port2 = RecordingPort(finished=True)
    other = _running(port2)
    other.receive(done, port2)
    assert not other.finished and other.next(AT_NORMAL, port2) is Wait.DONE
