"""The agent's pure decisions: restarts, hangs, spares."""

from __future__ import annotations

import pytest

from fastft.launch.rules.policy import (
    COLD_RESTART_DELAY_S,
    SpareInfo,
    after_exit,
    hang_reason,
    hang_verdict,
    pick_spare,
    spare_owed_done,
    startup_failed,
    waiters,
)
from fastft.process.beat import HANG_FLOOR_S
from fastft.protocol import EXIT_DRAINED
from fastft.protocol.exits import (
    EXIT_CHECKPOINTS_FAIL,
    EXIT_DATA_DIVERGED,
    EXIT_FAULT_STORM,
)

BASE = dict(
    rank=1,
    life=0,
    max_restarts=3,
    stopping=False,
    already_done=False,
    peers_finished=False,
    spares_left=True,
    elastic=False,
)


def test_a_clean_exit_or_a_stop_ends_the_slot():
    assert after_exit(code=0, sig=None, **BASE).done
    assert after_exit(code=None, sig=9, **dict(BASE, stopping=True)).done


def test_a_drained_worker_restarts_in_a_fixed_world_only_and_a_draining_agent_restarts_none():
    assert after_exit(code=EXIT_DRAINED, sig=None, **dict(BASE, life=3)).restart  # no failure
    assert after_exit(code=EXIT_DRAINED, sig=None, **dict(BASE, elastic=True)).done
    for code, sig in ((EXIT_DRAINED, None), (1, None), (None, 9)):
        do = after_exit(code=code, sig=sig, **dict(BASE, draining=True))
        assert do.done and not do.restart and do.failed is None


def test_a_crash_is_restarted_until_the_restarts_run_out():
    do = after_exit(code=1, sig=None, **BASE)
    assert do.restart and not do.done and do.delay_s == 0.0
    cold = after_exit(code=None, sig=9, **dict(BASE, spares_left=False, elastic=True))
    assert cold.restart and cold.delay_s == COLD_RESTART_DELAY_S
    out = after_exit(code=None, sig=9, **dict(BASE, life=3))
    assert out.done and out.failed and "--max-restarts 3" in out.failed and "signal 9" in out.failed


@pytest.mark.parametrize("world", [{}, {"elastic": True}, {"spares_left": False}])
def test_a_scripts_own_exit_status_is_that_workers_failure_whatever_its_value(world):
    """Any status 1-255 a script exits with by itself (no record of fastft's beside it), and
    any signal, is an ordinary failure of that worker: restarted while it has restarts,
    never the job's end for a reason fastft did not give, never a drain or a health check."""
    for code, sig in [*((c, None) for c in range(1, 256)), *((None, s) for s in range(1, 65))]:
        do = after_exit(code=code, sig=sig, **dict(BASE, **world), ours=False)
        assert do.restart and not do.done and not do.spare_only, (code, sig, do)
        last = after_exit(code=code, sig=sig, **dict(BASE, **world, life=3), ours=False)
        how = f"code {code}" if sig is None else f"signal {sig}"
        assert last.failed == f"rank 1 failed ({how}) and has no restarts left (--max-restarts 3)"
    assert after_exit(code=0, sig=None, **BASE, ours=False).done  # (0 needs no record)
    # the same statuses with fastft's record: its meanings
    assert after_exit(code=EXIT_DRAINED, sig=None, **dict(BASE, elastic=True)).done
    assert "fault storm" in (after_exit(code=EXIT_FAULT_STORM, sig=None, **BASE).failed or "")


def test_a_crash_after_the_job_finished_fails_it():
    do = after_exit(code=1, sig=None, **dict(BASE, peers_finished=True))
    assert do.done and not do.restart and "finished the job" in do.failed


def test_hangs_are_judged_after_the_start_grace_and_by_the_workers_pace():
    kw = dict(started=0.0, hang_timeout_s=30.0, by_pace=False, start_grace_s=120.0)
    assert hang_verdict(now=100.0, beat=None, pace=0.0, **kw) is None  # still starting
    h = hang_verdict(now=121.0, beat=None, pace=0.0, **kw)
    assert h is not None and h.silent_s == 121.0
    assert hang_verdict(now=40.0, beat=20.0, pace=0.05, **kw) is None  # --no-hang-pace
    assert hang_verdict(now=51.0, beat=20.0, pace=0.05, **kw).timeout_s == 30.0
    paced = dict(kw, by_pace=True)
    # a 60 ms step (50 ms of compute): 10x its pace is under the floor
    h = hang_verdict(now=20.0 + HANG_FLOOR_S + 0.01, beat=20.0, pace=0.05, **paced)
    assert h is not None and h.timeout_s == HANG_FLOOR_S and h.paced
    assert "10x its recent steps' compute" in hang_reason(1, 2, h)
    assert hang_verdict(now=23.5, beat=20.0, pace=0.4, **paced) is None  # 10 x 0.4 = 4 s
    assert hang_verdict(now=24.5, beat=20.0, pace=0.4, **paced).timeout_s == 4.0
    # before its pace is known (its first steps), --hang-timeout alone; never above it
    assert hang_verdict(now=40.0, beat=20.0, pace=0.0, **paced) is None
    h = hang_verdict(now=51.0, beat=20.0, pace=10.0, **paced)
    assert h is not None and h.timeout_s == 30.0 and not h.paced
    assert "--hang-timeout 30" in hang_reason(1, 2, h)


def test_a_step_after_a_recovery_may_compile_but_a_gil_hang_is_still_known_by_pace():
    # (JAX compiles an elastic world's new shapes in the step after its re-formation:
    # seconds in a step of 30 ms; the helper thread beats meanwhile, the GIL released)
    kw = dict(started=0.0, hang_timeout_s=5.0, by_pace=True, start_grace_s=120.0, pace=0.03)
    kw |= dict(unsettled_since=10.0)
    assert hang_verdict(now=14.0, beat=13.95, **kw) is None  # compiling 4 s: beats go on
    gil = hang_verdict(now=11.0, beat=10.3, **kw)  # no beat at all for 0.7 s: a GIL hang
    assert gil is not None and gil.paced and gil.timeout_s == HANG_FLOOR_S
    long = hang_verdict(now=15.5, beat=15.45, **kw)  # beating, but past --hang-timeout
    assert long is not None and long.timeout_s == 5.0 and long.silent_s == 5.5
    assert hang_verdict(now=15.5, beat=15.45, **dict(kw, unsettled_since=0.0)) is None
    # its main thread came back to the runtime at 13 s (a vote, a formation): from there
    back = dict(kw, main_beat=13.0)
    assert hang_verdict(now=15.5, beat=15.45, **back) is None
    assert hang_verdict(now=18.5, beat=18.45, **back).silent_s == 5.5


def test_a_member_waiting_on_its_peers_after_a_recovery_is_not_hung():
    # (issue 60: the only holder of the state waits in a heal for a restart that hangs
    # holding the GIL; it reached the hang bound first and was killed, the state lost)
    kw = dict(started=0.0, hang_timeout_s=5.0, by_pace=True, start_grace_s=120.0, pace=0.03)
    kw |= dict(unsettled_since=10.0, main_beat=10.0)
    assert hang_verdict(now=30.0, beat=29.95, waiting_since=10.0, **kw) is None
    assert hang_verdict(now=30.0, beat=29.95, **kw) is not None  # not waiting: away 20 s
    # the restart it waits on: silent (no helper beat either), judged by its own silence
    restart = dict(started=9.0, hang_timeout_s=5.0, by_pace=True, start_grace_s=120.0, pace=0.0)
    assert hang_verdict(now=15.1, beat=10.0, unsettled_since=10.0, **restart) is not None


def test_the_waiters_of_a_life_are_found_through_each_other():
    waits = {(0, 10): (1, 11), (2, 12): (0, 10), (3, 13): (1, 99), (4, 14): (4, 14)}
    assert waiters((1, 11), waits) == ((0, 10), (2, 12))  # rank 3 waits on an older life
    assert waiters((4, 14), waits) == ()  # (a cycle through itself is no waiter)
    assert waiters((5, 15), {}) == ()


def test_between_steps_only_a_stopped_interpreter_or_the_longer_timeout_is_a_hang():
    kw = dict(started=0.0, hang_timeout_s=5.0, by_pace=True, start_grace_s=120.0, pace=0.01)
    kw |= dict(between_timeout_s=600.0, between_since=10.0)
    # an evaluation of 100 s: the heartbeat thread beats, the main thread makes no progress
    assert hang_verdict(now=110.0, beat=109.9, **kw) is None
    stuck = hang_verdict(now=110.0, beat=100.0, **kw)  # a thread holds the GIL: no beats
    assert stuck is not None and not stuck.between and stuck.timeout_s == 5.0
    long = hang_verdict(now=611.0, beat=610.9, **kw)
    assert long is not None and long.between and long.silent_s == 601.0
    assert "--between-steps-timeout 600" in hang_reason(1, 0, long)
    assert "ft.no_hang_check()" in hang_reason(1, 0, stuck) and "no progress for 10.0 s" in (
        hang_reason(1, 0, stuck)
    )
    # a heartbeat left by an earlier life says nothing about this one
    assert hang_verdict(now=110.0, beat=109.9, **dict(kw, started=50.0, between_since=10.0)) is None


def test_a_restart_takes_a_spare_warm_on_its_gpu_then_a_ready_one_then_the_oldest():
    spares = [SpareInfo(10, 0, False), SpareInfo(11, 1, False), SpareInfo(12, None, True)]
    assert pick_spare(spares, 1).pid == 11
    assert pick_spare(spares, None).pid == 12
    assert pick_spare([SpareInfo(10, None, False), SpareInfo(11, None, False)], None).pid == 10
    assert pick_spare([SpareInfo(10, None, True, alive=False)], None) is None


def test_a_spare_handed_out_is_replaced_once_its_worker_recovered():
    kw = dict(now=1.0, deadline=2.0, same_life=True, slot_done=False, committed=False)
    assert not spare_owed_done(**kw)
    assert spare_owed_done(**dict(kw, committed=True))
    assert spare_owed_done(**dict(kw, same_life=False))
    assert spare_owed_done(**dict(kw, now=2.0))


def test_a_script_that_cannot_start_fails_the_job_after_one_round():
    assert startup_failed({0: True, 1: True})
    assert not startup_failed({0: True, 1: None})  # one still starting
    assert not startup_failed({0: True, 1: False})  # one committed, or ended otherwise
    assert not startup_failed({})


def test_a_fault_storm_fails_the_job_with_the_reason():
    out = after_exit(code=EXIT_FAULT_STORM, sig=None, **BASE)
    assert out.done and out.failed and "fault storm" in out.failed


@pytest.mark.parametrize(
    ("code", "why"),
    [
        (EXIT_DATA_DIVERGED, "different batches"),
        (EXIT_CHECKPOINTS_FAIL, "checkpoints keep failing"),
    ],
)
def test_a_job_that_cannot_go_on_right_fails_with_the_reason_and_no_restart(code, why):
    for elastic in (False, True):
        out = after_exit(code=code, sig=None, **{**BASE, "elastic": elastic})
        assert out.done and not out.restart and out.failed and why in out.failed


def test_an_elastic_world_below_its_floor_for_good_is_a_failure():
    from fastft.launch.rules.policy import floor_lost

    assert "below --min-replicas 2 for good: 1 of 3" in (floor_lost(1, 2, 3) or "")
    assert floor_lost(0, 2, 4) is not None
    assert floor_lost(2, 2, 3) is None  # at the floor: it goes on
    assert floor_lost(1, None, 3) is None  # a fixed world restarts drained ranks
    assert floor_lost(1, 3, 3) is None  # --min-replicas = world: fixed


def test_a_drain_whose_grace_ran_out_says_whom_it_stopped():
    import signal

    from fastft.launch.rules.policy import drain_late_line, stopped_by

    assert drain_late_line(["2.0"], 30.0) == (
        "fastft: drain: rank 2.0 still running after --drain-grace 30 s"
    )
    assert stopped_by(signal.SIGTERM, "SIGTERM", ["2.0"]) == (
        "SIGTERM; rank 2.0 stopped after the drain's grace"
    )
    assert stopped_by(signal.SIGTERM, None, []) == "signal 15"
    assert stopped_by(signal.SIGINT, None, []) == "Ctrl-C"


def test_a_worker_the_machine_kept_off_the_cpu_is_judged_by_the_rest_of_its_silence():
    # (CI, a Ray job on 2 cores: a worker whose GIL holder waited 0.38 s of 0.7 s for a
    # core was silent 0.5 s in its commit and killed as hung by its 0.5 s pace)
    kw = dict(started=0.0, hang_timeout_s=30.0, by_pace=True, start_grace_s=120.0, pace=0.03)
    assert hang_verdict(now=20.6, beat=20.0, kept_off=0.5, **kw) is None  # 0.3 s of its own
    h = hang_verdict(now=21.2, beat=20.0, kept_off=0.5, **kw)  # 0.6 s of its own: hung
    assert h is not None and h.paced and h.timeout_s == HANG_FLOOR_S and h.kept_off == 0.5
    assert "kept it off the CPU 50% of that time" in hang_reason(1, 2, h)
    h = hang_verdict(now=20.6, beat=20.0, kept_off=0.0, **kw)  # on a machine that ran it
    assert h is not None and h.kept_off == 0.0 and "off the CPU" not in hang_reason(1, 2, h)
    # never run at all: its pace says nothing; --hang-timeout still ends it
    assert hang_verdict(now=49.0, beat=20.0, kept_off=1.0, **kw) is None
    h = hang_verdict(now=51.0, beat=20.0, kept_off=1.0, **kw)
    assert h is not None and not h.paced and h.timeout_s == 30.0
