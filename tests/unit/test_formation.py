"""Epoch formation's decisions (pure): who is admitted, who heals, who sends."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine.formation import Arrival, Recovery, close_after, close_first

NOTHING = Recovery()
PREV = EpochView(4, (Member(0, 10), Member(1, 11), Member(2, 12)), 7, frozenset(), 0)


def _close(
    arrived,
    joiners=None,
    expected=(0, 1, 2),
    timed_out=False,
    admit=True,
    min_members=3,
    recovery=NOTHING,
):
    return close_after(
        PREV,
        arrived,
        joiners or {},
        expected=list(expected),
        timed_out=timed_out,
        admit=admit,
        min_members=min_members,
        recovery=recovery,
    )


def test_waits_for_every_expected_survivor_until_the_deadline():
    arrived = {0: Arrival(10, 7, False), 1: Arrival(11, 7, False)}
    assert _close(arrived) is None
    view = _close(arrived, joiners={2: 99}, timed_out=True)
    assert view is not None and view.epoch == 5
    assert view.members == (Member(0, 10), Member(1, 11), Member(2, 99))
    assert view.needs_state == {2} and view.source == 0 and view.step == 7


def test_below_min_members_it_waits_for_restarted_workers():
    arrived = {0: Arrival(10, 7, False), 1: Arrival(11, 7, False)}
    assert _close(arrived, expected=(0, 1)) is None
    assert _close(arrived, expected=(0, 1), min_members=2).members == (Member(0, 10), Member(1, 11))


def test_a_survivor_that_lost_its_state_heals_from_the_lowest_that_holds_it():
    arrived = {r: Arrival(10 + r, 7, r == 0) for r in range(3)}
    view = _close(arrived)
    assert view.source == 1 and view.needs_state == {0}


def test_an_elastic_retry_leaves_joiners_waiting_when_the_survivors_are_enough():
    arrived = {0: Arrival(10, 7, False), 1: Arrival(11, 7, False, kept=(0, 4, 8))}
    view = _close(arrived, joiners={2: 99}, expected=(0, 1), admit=False, min_members=2)
    assert view.waiting == (2,) and Member(2, 99) not in view.members
    assert view.kept == ((1, 0, 4, 8),)


def test_survivors_that_all_lost_their_state_are_never_admitted_as_holders():
    # the silent divergence: every survivor arrived without the state
    arrived = {0: Arrival(10, 9, True), 1: Arrival(11, 9, True)}
    view = _close(arrived, expected=(0, 1), min_members=2)
    assert view.fatal and view.lost == 9 and view.step == 9
    assert EpochView.from_json(view.to_json()) == view


def test_a_suspect_state_heals_from_a_clean_holder_and_serves_when_none_is_left():
    """An in-process restart leaves a suspect state: it heals from a clean holder; when
    every survivor is suspect (every rank raised in an evaluation), the lowest serves."""
    mixed = {0: Arrival(10, 7, False, suspect=True), 1: Arrival(11, 7, False)}
    view = _close({**mixed, 2: Arrival(12, 7, False)})
    assert view is not None and view.source == 1 and view.needs_state == {0}
    every = {r: Arrival(10 + r, 7, False, suspect=True) for r in range(3)}
    view = _close(every)
    assert view is not None and view.restore is None and view.lost is None
    assert view.step == 7 and view.source == 0 and view.needs_state == {1, 2}
    lost_too = {0: Arrival(10, 7, True), 1: Arrival(11, 7, False, suspect=True)}
    view = _close({**lost_too, 2: Arrival(12, 7, True)})
    assert view is not None and view.source == 1 and view.needs_state == {0, 2}


def test_a_total_loss_restores_the_checkpoint_on_every_member():
    arrived = {0: Arrival(10, 9, True), 1: Arrival(11, 9, True)}
    view = _close(arrived, {2: 99}, expected=(0, 1), recovery=Recovery(checkpoint=5))
    assert view.restore == 5 and view.step == 5 and view.lost == 9 and not view.fatal
    assert view.source is None and not view.needs_state  # every member loads it
    assert EpochView.from_json(view.to_json()) == view


def test_a_fresh_start_takes_a_fresh_process_as_its_source_and_only_when_allowed():
    arrived = {0: Arrival(10, 9, True), 1: Arrival(11, 9, True)}
    allowed = Recovery(fresh_start=True)
    view = _close(arrived, {2: 99}, expected=(0, 1), recovery=allowed)
    assert view.step == 0 and view.source == 2 and view.needs_state == {0, 1}
    assert view.lost == 9 and not view.fatal
    # without a fresh process to start from, the members restart as fresh ones
    assert _close(arrived, expected=(0, 1), min_members=2, recovery=allowed).fatal
    assert _close(
        arrived, {2: 99}, expected=(0, 1)
    ).fatal  # and not at all without --allow-fresh-start


def test_a_holder_wins_over_any_checkpoint():
    arrived = {0: Arrival(10, 9, True), 1: Arrival(11, 9, False)}
    view = _close(arrived, expected=(0, 1), min_members=2, recovery=Recovery(checkpoint=5))
    assert view.source == 1 and view.restore is None and view.lost is None


def test_when_every_worker_was_lost_the_joiners_restore_or_fail():
    joiners = {0: 20, 1: 21, 2: 22}
    kw = dict(me=0, latest=6, world_size=3, min_members=3, waited_s=0.0, start_timeout_s=1.0)
    view = close_first(joiners, **kw, last_step=40)
    assert view.fatal and view.lost == 40 and view.epoch == 7
    view = close_first(joiners, **kw, last_step=40, recovery=Recovery(checkpoint=35))
    assert view.restore == 35 and view.step == 35 and view.lost == 40 and not view.needs_state
    view = close_first(joiners, **kw, last_step=40, recovery=Recovery(fresh_start=True))
    assert view.step == 0 and view.source == 0 and view.lost == 40


def test_after_every_worker_was_lost_an_elastic_world_regroups_without_the_slow_slots():
    # a slot may be gone for good (drained, its node lost) or its restart lost again:
    # waiting for every slot could wait forever
    joiners = {0: 20, 3: 23}
    kw = dict(me=0, latest=6, world_size=4, start_timeout_s=300.0, regroup_timeout_s=5.0)
    ckpt = dict(last_step=40, recovery=Recovery(checkpoint=35))
    assert close_first(joiners, **kw, min_members=2, waited_s=4.0, **ckpt) is None
    view = close_first(joiners, **kw, min_members=2, waited_s=5.5, **ckpt)
    assert view is not None and view.restore == 35 and view.lost == 40
    assert view.members == (Member(0, 20), Member(3, 23))
    assert close_first({0: 20}, **kw, min_members=2, waited_s=60.0, **ckpt) is None
    # a member of epoch 6 answered lately (issue 60, case 8): not every worker was lost,
    # so no joiner forms a world of its own, however long it waited...
    assert close_first(joiners, **kw, min_members=2, waited_s=60.0, live=True, **ckpt) is None
    # ...but every slot a joiner is every member's slot with a new life: they close
    everyone = {0: 20, 1: 21, 2: 22, 3: 23}
    assert close_first(everyone, **kw, min_members=2, waited_s=0.0, live=True, **ckpt)
    assert close_first(joiners, **kw, min_members=4, waited_s=60.0, **ckpt) is None  # fixed
    # the first start keeps its own (longer) wait
    first = dict(kw, latest=0)
    assert close_first(joiners, **first, min_members=2, waited_s=60.0) is None


def test_a_first_start_resumes_from_the_checkpoint():
    kw = dict(me=0, latest=0, world_size=2, min_members=2, waited_s=0.0, start_timeout_s=1.0)
    view = close_first({0: 20, 1: 21}, **kw, recovery=Recovery(checkpoint=35))
    assert view.restore == 35 and view.step == 35 and view.lost is None
    assert close_first({0: 20, 1: 21}, **kw).lost is None  # a plain first start


def test_a_suspect_arrival_round_trips_and_an_old_one_reads_as_clean():
    a = Arrival(5, 3, False, suspect=True)
    assert Arrival.from_json(a.to_json()) == a
    assert Arrival.from_json('{"inc": 5, "step": 3, "lost": false}').suspect is False


def test_arrivals_round_trip_through_the_store():
    for a in (Arrival(5, 3, False), Arrival(5, 3, True), Arrival(5, 3, False, kept=(1, 2, 9))):
        assert Arrival.from_json(a.to_json()) == a
    assert Arrival.from_json(Arrival(5, 3, True, kept=(1, 2, 9)).to_json()).kept is None


def test_the_first_epoch_is_closed_by_the_lowest_joiner_once_every_slot_is_there():
    joiners = {0: 10, 1: 11, 2: 12}
    kw = dict(latest=0, world_size=3, min_members=3, waited_s=0.0, start_timeout_s=300.0)
    assert close_first(joiners, me=1, **kw) is None
    view = close_first(joiners, me=0, **kw)
    assert view is not None and view.epoch == 1 and view.source == 0
    assert view.needs_state == {1, 2}
    assert close_first({0: 10, 1: 11}, me=0, **kw) is None
    late = dict(kw, min_members=2, waited_s=301.0)
    assert close_first({0: 10, 1: 11}, me=0, **late).members == (Member(0, 10), Member(1, 11))


@given(
    st.dictionaries(
        st.integers(0, 2),
        st.tuples(st.integers(1, 50), st.integers(0, 9), st.booleans()),
        min_size=1,
    ),
    st.dictionaries(st.integers(3, 5), st.integers(1, 50), max_size=2),
)
def test_every_closed_view_is_consistent(arrivals, joiners):
    arrived = {r: Arrival(inc, step, lost) for r, (inc, step, lost) in arrivals.items()}
    view = close_after(
        PREV, arrived, joiners, expected=[0, 1, 2], timed_out=True, admit=True, min_members=1
    )
    assert view is not None
    ranks = [m.rank for m in view.members]
    assert ranks == sorted(ranks) and set(ranks) == set(arrived) | set(joiners)
    with_state = {r for r, a in arrived.items() if not a.lost}
    if with_state:
        # the newest step a survivor holds; a survivor behind it heals (a step its
        # collective decided, interrupted on that survivor first)
        top = max(arrived[r].step for r in with_state)
        holders = {r for r in with_state if arrived[r].step == top}
        assert view.source == min(holders)
        assert view.step == top
        assert view.needs_state == (set(ranks) - holders)
    else:  # nothing restores it: the job cannot go on, never a silent step 0 (PREV.step > 0)
        assert view.fatal and view.lost == max([PREV.step, *(a.step for a in arrived.values())])
        assert view.source is None and not view.needs_state


def test_before_the_first_commit_a_total_loss_starts_from_a_fresh_process():
    """Nothing was committed: the state is the initial one, which a fresh process holds.
    (The source of the first heal died during it: the job failed with "every holder of
    the committed state (step 0) was lost"; found by the simulator.)"""
    first = EpochView(1, (Member(0, 10), Member(1, 11), Member(2, 12)), 0, frozenset({1, 2}), 0)
    arrived = {1: Arrival(11, 0, True), 2: Arrival(12, 0, True)}
    view = close_after(
        first, arrived, {0: 13}, expected=[1, 2], timed_out=False, admit=True, min_members=3
    )
    assert not view.fatal and view.step == 0 and view.lost == 0
    assert view.source == 0 and view.needs_state == {1, 2}
    # every worker lost before the first commit: the lowest joiner's state, not a failure
    kw = dict(me=0, latest=1, world_size=3, min_members=3, waited_s=0.0, start_timeout_s=1.0)
    view = close_first({0: 20, 1: 21, 2: 22}, **kw, last_step=0)
    assert not view.fatal and view.step == 0 and view.source == 0


def test_members_that_go_back_to_their_verified_state_rewind_together():
    """A replica mismatch's repair: every survivor lost its state on purpose and offers
    the same verified step: the view restores it from each member's own copy (not the
    durable checkpoint, which may hold the corruption); a joiner, who holds no copy,
    waits; a survivor that offers none (or another step) leaves it to the usual rules."""
    back = {r: Arrival(10 + r, 7, True, rewind=5) for r in (0, 1, 2)}
    view = _close(back, recovery=Recovery(checkpoint=6))
    assert view is not None and view.rewind and (view.restore, view.step) == (5, 5)
    assert view.lost == 7 and not view.needs_state and view.source is None
    assert EpochView.from_json(view.to_json()) == view
    again = Arrival.from_json(back[0].to_json())
    assert again == back[0] and Arrival.from_json(Arrival(1, 7, False).to_json()).rewind is None
    joined = _close({**back, 3: back[2]}, joiners={4: 99}, expected=(0, 1, 2, 3), min_members=3)
    assert joined is not None and joined.rewind and joined.waiting == (4,)
    mixed = _close({**back, 2: Arrival(12, 7, True)}, recovery=Recovery(checkpoint=6))
    assert mixed is not None and not mixed.rewind and mixed.restore == 6


def test_a_survivor_interrupted_before_its_verdict_goes_back_with_the_others():
    """A replica mismatch's repair, as it raced in CI: rank 2 was still in the gather of
    the checksums when its peers, done with it, declared their states lost (the bus
    interrupted it): it arrives holding its state, which may be the corrupted one, and
    the verified copy of step 5. It goes back with them, never serving its state; a
    survivor that holds no copy of step 5 leaves it to the usual rules (it serves)."""
    raced = {0: Arrival(10, 9, True, rewind=5), 1: Arrival(11, 9, True, rewind=5)}
    view = _close({**raced, 2: Arrival(12, 9, False, rewind=5)})
    assert view is not None and view.rewind and (view.restore, view.step, view.lost) == (5, 5, 9)
    assert [m.rank for m in view.members] == [0, 1, 2] and not view.needs_state
    other = _close({**raced, 2: Arrival(12, 9, False, rewind=0)})
    assert other is not None and not other.rewind and other.source == 2
    assert other.needs_state == {0, 1}
    held = Arrival(12, 9, False, rewind=5)
    assert Arrival.from_json(held.to_json()) == held  # (the step it holds travels too)
    # every survivor holds the verified copy, none asked for it: no rewind
    calm = _close({r: Arrival(10 + r, 9, False, rewind=5) for r in (0, 1, 2)})
    assert calm is not None and not calm.rewind and calm.restore is None


def test_a_start_goes_on_from_the_scripts_own_checkpoint_unless_the_durable_tier_is_newer():
    """``ft.register(step=8)``: every joiner loaded the state of step 8 itself; the lowest
    sends its own so that every replica starts equal (after every worker was lost too)."""
    joiners = {0: 10, 1: 11, 2: 12}
    kw = dict(me=0, world_size=3, min_members=3, waited_s=0.0, start_timeout_s=60.0)
    view = close_first(joiners, latest=0, **kw, recovery=Recovery(resume=8))
    assert view is not None and (view.step, view.source, view.restore) == (8, 0, None)
    assert view.needs_state == {1, 2} and view.lost is None
    newer = close_first(joiners, latest=0, **kw, recovery=Recovery(checkpoint=10, resume=8))
    assert newer is not None and (newer.restore, newer.step) == (10, 10)
    older = close_first(joiners, latest=0, **kw, recovery=Recovery(checkpoint=4, resume=8))
    assert older is not None and (older.step, older.restore) == (8, None)
    lost = close_first(joiners, latest=3, last_step=20, **kw, recovery=Recovery(resume=12))
    assert lost is not None and not lost.fatal and (lost.step, lost.lost) == (12, 20)
