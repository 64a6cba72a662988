"""The agent's decisions, as pure functions over data: restart or give up after an exit,
whether a worker is hung, which spare a restart takes, when a spare handed out is
replaced. The agent's loop (:mod:`fastft.launch.agent`) performs what they return."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from fastft.process.beat import HANG_PACES, hang_limit
from fastft.protocol.exits import (
    ENDS_THE_JOB,
    EXIT_CHECKPOINTS_FAIL,
    EXIT_DATA_DIVERGED,
    EXIT_DRAINED,
    EXIT_FAULT_STORM,
    EXIT_REPLICAS_DIVERGED,
    EXIT_SCRIPT_ERROR,
    EXIT_STATE_LOST,
    EXIT_UNHEALTHY,
    FASTFT_STATUSES,
)

__all__ = [
    "COLD_RESTART_DELAY_S",
    "SPARE_REFILL_MAX_S",
    "AfterExit",
    "Hung",
    "SpareInfo",
    "after_exit",
    "group_mates",
    "hang_reason",
    "hang_verdict",
    "pick_spare",
    "resume_hint",
    "spare_owed_done",
    "startup_failed",
    "waiters",
]

COLD_RESTART_DELAY_S = 0.05
"""In an elastic world, how long a cold restart waits after the exit: a cold start forks
the agent (tens of MB of page tables), which slows the store it hosts while the survivors
re-form through it, and they do not wait for the restart."""
SPARE_REFILL_MAX_S = 2.0
"""A spare handed out is replaced once the worker it became has committed, or after this
long: a new spare's imports (~1 s of CPU) would compete with the recovery it is part of."""


_ENDS_THE_JOB = {
    EXIT_FAULT_STORM: "too many recoveries in a row without a committed step (a fault "
    "storm; the worker's message says which faults; --max-recoveries)",
    EXIT_DATA_DIVERGED: "the members drew different batches from fastft.Batches (the "
    "worker's message says at which step); training on would use the wrong data: make the "
    "loader's order a function of its state",
    EXIT_REPLICAS_DIVERGED: "the replicas hold different state (the in-band replica "
    "check; the worker's message names what differs, on which members, and the likely "
    "cause); training on would give a different model on every member",
    EXIT_SCRIPT_ERROR: "the script uses fastft in a way that cannot work, or raised an "
    "error of its own twice the same way (the worker's message says which, and what to "
    "change); a restart would fail the same way",
    EXIT_CHECKPOINTS_FAIL: "checkpoints keep failing to be written (the worker's message "
    "says why); fix --checkpoint-dir and run again",
    EXIT_STATE_LOST: "every holder of the committed state was lost and nothing could "
    "restore it (the worker's message says what to change)",
}
"""Why the job fails, for each worker status in :data:`ENDS_THE_JOB`."""
assert set(_ENDS_THE_JOB) == ENDS_THE_JOB


@dataclass(frozen=True)
class AfterExit:
    """What to do with a slot whose worker exited: ``restart`` after ``delay_s``, or mark
    it ``done``; ``failed``: the job fails, with this reason."""

    restart: bool = False
    delay_s: float = 0.0
    done: bool = False
    failed: str | None = None
    spare_only: bool = False
    """The slot's next life must be a warm spare (a failed health check, a quarantine)."""
    shrink: str | None = None
    """The slot is done and the elastic world goes on without it, for this reason."""


def after_exit(
    *,
    rank: int,
    code: int | None,
    sig: int | None,
    life: int,
    max_restarts: int,
    stopping: bool,
    already_done: bool,
    peers_finished: bool,
    spares_left: bool,
    elastic: bool,
    draining: bool = False,
    quarantined: str | None = None,
    ours: bool = True,
    replaced: bool = False,
) -> AfterExit:
    """A worker of slot ``rank`` in its ``life`` exited with ``code`` or signal ``sig``.
    ``peers_finished``: another slot's worker ended the job cleanly already;
    ``draining``: the agent drains its workers (a SIGTERM, ``fastft drain --node``).

    A drained worker (:data:`EXIT_DRAINED`) left on purpose: in a fixed world it starts
    again (a new life that heals; not counted against ``max_restarts``), in an elastic
    world, or when its agent drains, the slot is done; ``replaced`` (a straggler asked to
    drain: :mod:`fastft.launch.gray.stragglers`) starts again in either.

    A worker that failed its health check (:data:`EXIT_UNHEALTHY`), or a slot
    ``quarantined`` (a repeat offender: why), does not start again in place: a warm spare
    takes its place, or the world shrinks (elastic), or the job stops with the reason.

    ``ours``: a status of :data:`FASTFT_STATUSES` is fastft's (the worker recorded it);
    False, it is the script's own (``sys.exit(93)``): an ordinary failure of the worker."""
    meant = code if ours or code not in FASTFT_STATUSES else None  # (fastft's meaning)
    if code == 0 or stopping or already_done or draining:
        return AfterExit(done=True)
    if meant in ENDS_THE_JOB:
        return AfterExit(done=True, failed=f"rank {rank}: {_ENDS_THE_JOB[meant]}")
    if meant == EXIT_UNHEALTHY or quarantined:
        why = quarantined or f"rank {rank} failed its health check (its reason is above)"
        if peers_finished:
            return AfterExit(done=True, shrink=why)  # (it was not needed any more)
        if life >= max_restarts:
            return AfterExit(
                done=True, failed=f"{why}; no restarts left (--max-restarts {max_restarts})"
            )
        if spares_left:
            return AfterExit(restart=True, spare_only=True)
        if elastic:
            return AfterExit(done=True, shrink=why)
        return AfterExit(
            done=True,
            failed=f"{why}, and no warm spare can take its place in this fixed world "
            "(--warm-spares N gives it one; --min-replicas lets the world shrink)",
        )
    if meant == EXIT_DRAINED:
        if peers_finished or (elastic and not replaced):
            return AfterExit(done=True)
        return AfterExit(restart=True)
    how = f"code {code}" if sig is None else f"signal {sig}"
    if peers_finished:
        # there is nothing left to rejoin
        return AfterExit(
            done=True,
            failed=f"rank {rank} failed ({code=}, {sig=}) after other workers had finished the job",
        )
    if life < max_restarts:
        return AfterExit(
            restart=True, delay_s=COLD_RESTART_DELAY_S if elastic and not spares_left else 0.0
        )
    return AfterExit(
        done=True,
        failed=f"rank {rank} failed ({how}) and has no restarts left (--max-restarts {max_restarts})",
    )


def floor_lost(left: int, min_replicas: int | None, world: int) -> str | None:
    """Why an elastic job cannot go on, or None: ``left`` of the job's ``world`` slots can
    still run (alive, or restarting; the others are done for good: drained, shrunk,
    quarantined) and the world needs ``--min-replicas``. One agent counts its own slots;
    with several nodes the count is the job's, kept in the store (``slots_gone``)."""
    if min_replicas is None or min_replicas >= world or left >= min_replicas:
        return None
    return (
        f"the elastic world fell below --min-replicas {min_replicas} for good: {left} of "
        f"{world} workers left, and nothing starts the others again (they drained, or no "
        "spare could take their place)"
    )


def startup_failed(first_lives: dict[int, bool | None]) -> bool:
    """Whether the job fails as a whole at its start: every slot's first life has ended
    (``first_lives``: rank -> True if it failed before its first commit, False if it
    ended otherwise or committed, None while it runs) and every one failed before its
    first commit. A script that cannot start (an import error, a syntax error, a bad
    argument) then fails the job once, instead of every worker ``max_restarts`` times."""
    return bool(first_lives) and all(v is True for v in first_lives.values())


def group_mates(
    rank: int, incarnation: int, shard_size: int, lives: dict[int, int], taken_down: Set[int]
) -> list[int] | None:
    """A worker of a shard group (``shard_size`` > 1) exited and restarts: the ranks of its
    group whose lives ``lives`` (rank -> incarnation, this node's) the agent takes down
    with it, so that the group starts again as a whole and its members meet anew (their
    FSDP collectives cannot go on without it, and Gloo cannot abort them). None when the
    exit was itself the agent's doing (``incarnation`` in ``taken_down``) or there are no
    shard groups."""
    if shard_size <= 1 or incarnation in taken_down:
        return None
    first = rank - rank % shard_size
    return [r for r in range(first, first + shard_size) if r != rank and r in lives]


@dataclass(frozen=True)
class Hung:
    """``silent_s`` without progress, past ``timeout_s``; ``between``: the worker was
    between steps (its interpreter ran, for longer than ``--between-steps-timeout``), else
    it made no progress at all (in a step, or an interpreter that stopped running)."""

    silent_s: float
    timeout_s: float
    between: bool = False
    paced: bool = False
    """The timeout came from the worker's pace (else ``--hang-timeout``)."""
    kept_off: float = 0.0
    """The share of its silence the machine kept it off the CPU (a paced verdict counts
    only the rest: :func:`hang_verdict`)."""


def hang_verdict(
    *,
    now: float,
    started: float,
    beat: float | None,
    pace: float,
    hang_timeout_s: float,
    by_pace: bool,
    start_grace_s: float,
    between_since: float = 0.0,
    between_timeout_s: float = float("inf"),
    unsettled_since: float = 0.0,
    main_beat: float = 0.0,
    waiting_since: float = 0.0,
    kept_off: float = 0.0,
) -> Hung | None:
    """Whether a worker started at ``started`` whose last heartbeat is ``beat`` (None: none
    yet) and whose pace is ``pace`` (:class:`fastft.process.heartbeat.Beat`) is hung at
    ``now``: in a step, after :func:`~fastft.process.heartbeat.hang_limit` of silence.
    ``between_since``: since when it is between steps (0: in one). Between steps its
    heartbeat thread beats while the interpreter runs: a long evaluation or checkpoint is
    not a hang until ``between_timeout_s``; only an interpreter that stops running (a
    thread holding the GIL) is hung after ``hang_timeout_s``. ``unsettled_since``: since
    when it is in a step after a recovery or a new epoch (its helper thread beats while
    the interpreter runs: a compile is not a hang); its main thread may stay away from the
    runtime for ``hang_timeout_s`` (from ``main_beat``, its own last beat). While it waits
    in the runtime (``waiting_since``) it is no hang: it waits on a peer, whose own
    heartbeat is judged (the chain's end; :func:`waiters`). ``kept_off``: the share of the
    silence its threads waited for a CPU (:mod:`fastft.process.sched`): a pace measured
    while the machine ran the worker says nothing of a worker it does not run, so a paced
    limit counts only the rest of the silence (a whole share: ``hang_timeout_s`` alone)."""
    if beat is None or beat < started:
        if now - started <= start_grace_s:
            return None  # still starting (imports): no heartbeat yet
        beat = started
    silent = now - beat
    if between_since >= started and between_since > 0:
        if silent > hang_timeout_s:
            return Hung(silent, hang_timeout_s)
        idle = now - between_since
        return Hung(idle, between_timeout_s, between=True) if idle > between_timeout_s else None
    timeout = hang_limit(pace, hang_timeout_s, by_pace=by_pace)
    if timeout < hang_timeout_s:  # (paced)
        share = min(max(kept_off, 0.0), 1.0)
        if silent * (1.0 - share) > timeout:
            return Hung(silent, timeout, paced=True, kept_off=share)
        timeout = hang_timeout_s
    if silent > timeout:
        return Hung(silent, timeout)
    if unsettled_since >= started and unsettled_since > 0 and not waiting_since:
        own = max(unsettled_since, main_beat)  # (the step's start, or the main thread's beat)
        if now - own > hang_timeout_s:
            return Hung(now - own, hang_timeout_s)  # (a step after a recovery, away too long)
    return None


def waiters(
    life: tuple[int, int], waits_on: Mapping[tuple[int, int], tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """The lives, as (rank, incarnation), that wait on ``life`` directly or through each
    other, given what each waits on (``waits_on``: a waiter's life -> the life it waits
    on): the members a verdict against ``life`` releases, named in its line."""
    found: set[tuple[int, int]] = set()
    ends = {life}
    while True:
        more = {w for w, on in waits_on.items() if on in ends and w not in found | {life}}
        if not more:
            return tuple(sorted(found))
        found |= more
        ends |= more


def hang_reason(rank: int, life: int, hung: Hung) -> str:
    """The one line the agent prints before a hung worker's stacks."""
    t = f"{hung.silent_s:.1f} s"
    if hung.between:
        return (
            f"rank {rank} (life {life}) hung: {t} between steps (--between-steps-timeout "
            f"{hung.timeout_s:g}); killing it, its stacks follow"
        )
    why = (
        f"{hung.timeout_s:.2g} s: {HANG_PACES:g}x its recent steps' compute; --no-hang-pace "
        "turns that off"
        if hung.paced
        else f"--hang-timeout {hung.timeout_s:g}"
    )
    if hung.kept_off >= 0.005:
        why += f"; the machine kept it off the CPU {hung.kept_off:.0%} of that time"
    return (
        f"rank {rank} (life {life}) hung: no progress for {t} in a step ({why}); killing "
        "it, its stacks follow. Long work between steps is not a hang; inside a step or a "
        "wait of your own, wrap it in ft.no_hang_check()"
    )


@dataclass(frozen=True)
class SpareInfo:
    pid: int
    gpu: int | None
    ready: bool
    alive: bool = True


def pick_spare(spares: Sequence[SpareInfo], gpu: int | None) -> SpareInfo | None:
    """The spare a restart on ``gpu`` takes: a live one that warmed ``gpu`` if there is one
    (a CUDA context costs ~0.4 s), else a ready one (a spare still warming up has up to its
    imports left), else the oldest (the first listed)."""
    live = [s for s in spares if s.alive]
    if not live:
        return None
    return max(live, key=lambda s: (s.gpu == gpu, s.ready))


def spare_owed_done(
    *, now: float, deadline: float, same_life: bool, slot_done: bool, committed: bool
) -> bool:
    """Whether a spare handed out to a slot is replaced now: its worker committed, died
    again (``same_life`` False) or ended, or it waited until ``deadline``."""
    return now >= deadline or not same_life or slot_done or committed


def drain_late_line(late: Sequence[str], grace_s: float) -> str:
    """The agent's line for the lives (``rank.life``) still running when a drain's grace
    ran out: it stops them."""
    return f"fastft: drain: rank {', '.join(late)} still running after --drain-grace {grace_s:g} s"


def stopped_by(signum: int, drain_why: str | None, late: Sequence[str]) -> str:
    """What stopped the job, for the agent's last line: Ctrl-C, a signal, or a drain whose
    grace ran out (``late``: the lives it stopped; not every worker drained)."""
    if late:
        return f"{drain_why}; rank {', '.join(late)} stopped after the drain's grace"
    return "Ctrl-C" if signum == signal.SIGINT else f"signal {signum}"


def resume_hint(checkpoint_dir: str | None) -> str:
    """What the agent's line says of a job stopped or preempted: how it resumes."""
    if checkpoint_dir:
        return (
            "resumable: run the same command again and it restores the newest "
            f"checkpoint in {checkpoint_dir}"
        )
    return (
        "the trained state is not kept without --checkpoint-dir: the same command "
        "starts again at step 0"
    )
