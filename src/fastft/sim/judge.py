"""The agents' hang judge in the simulator: the real
:func:`fastft.launch.rules.policy.hang_verdict` over the heartbeat each simulated life would
write (:class:`fastft.process.heartbeat.HeartbeatWriter`), read from where its main
thread is (``Life.pc``). A life in a runtime wait (a collective, a heal, a vote, a
formation, a join) is blocked: its helper thread beats, the wait began at ``since``; a
life computing beats at its step's start; the driver's loop beats itself; a stopped life
(a SIGSTOP, a GIL hang) beats no more from when it stopped. The world asks it when a
stopped life's hang timeout has passed: every verdict it returns then against a life that
runs is one against a member waiting on the faulty peer (issue 60: the holder, healing a
restart that hung, was killed first, 6 of 6 runs), and the stopped one must be judged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fastft.launch.rules import policy

if TYPE_CHECKING:
    from fastft.sim.life import Life

__all__ = ["BLOCKED", "beat_of", "judge"]

BLOCKED = ("pg", "heal", "vote", "form", "join")
"""The runtime's waits: the main thread blocked, the helper thread beating for it."""


def beat_of(life: Life, now: float) -> dict[str, Any]:
    """What ``life``'s heartbeat says at ``now``, as :func:`policy.hang_verdict` takes it."""
    pc = life.pc
    since = max(life.since, life.born)
    blocked = pc[0] in BLOCKED or (pc[0] == "compute" and pc[-1] is True)
    unsettled = since if life.recoveries else 0.0
    if life.frozen:  # (no thread runs: the last beat is when it stopped)
        at = life.frozen_at
        return dict(beat=at, main_beat=min(at, since), waiting_since=since if blocked else 0.0,
                    unsettled_since=unsettled)  # fmt: skip
    if blocked:
        return dict(beat=now, main_beat=since, waiting_since=since, unsettled_since=unsettled)
    if pc[0] == "drive":  # (the driver's loop beats from the main thread)
        return dict(beat=now, main_beat=now, unsettled_since=unsettled)
    # computing (a step, an in-process restart's start): silent since it began, but an
    # unsettled step's helper thread beats while the interpreter runs
    return dict(beat=now if unsettled else since, main_beat=since, unsettled_since=unsettled)


def judge(lives: Iterable[Life], now: float, hang_timeout_s: float) -> dict[Life, policy.Hung]:
    """The agents' verdicts at ``now`` on ``lives`` (by ``--hang-timeout`` alone: the
    simulated steps have no pace worth the name)."""
    out = {}
    for life in lives:
        hung = policy.hang_verdict(
            now=now,
            started=life.born,
            pace=0.0,
            hang_timeout_s=hang_timeout_s,
            by_pace=False,
            start_grace_s=hang_timeout_s,
            **beat_of(life, now),
        )
        if hung is not None:
            out[life] = hung
    return out
