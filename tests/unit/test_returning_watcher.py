"""A watcher that was cut off itself holds its verdicts while its connections come back
(:func:`fastft.launch.rules.leasewatch.held_after_return`, pure) and what
:class:`fastft.launch.nodes.beats.Beats` records for it (its own beats' gap, when each node
was last heard), on a clock the test moves."""

from __future__ import annotations

from fastft.launch.nodes.beats import Beat, Beats, beat_subject, encode
from fastft.launch.rules.leasewatch import held_after_return
from fastft.protocol.auth import JobSecret, ValueAuth

LEASE = 0.8


def _held(now: float, back: float, gap: float, heard: float, own: float | None = None) -> bool:
    """With its own beats heard just now unless ``own`` says when."""
    return held_after_return(now, now if own is None else own, back, gap, heard, LEASE)


def test_a_watcher_never_cut_off_holds_nothing():
    assert not _held(100.0, 0.0, 0.0, 0.0)
    assert not _held(100.0, 0.0, 0.0, 99.0)


def test_a_watcher_that_has_not_heard_its_own_beats_for_two_thirds_of_a_lease_holds():
    # (the case met: its own last beat came a round after the others' last ones)
    assert _held(100.0, 0.0, 0.0, 99.2, own=99.3)
    assert not _held(100.0, 0.0, 0.0, 99.2, own=99.5)


def test_for_two_leases_after_its_return_it_declares_nobody():
    back, gap = 50.0, 8.0
    assert _held(back + 1.5, back, gap, back + 0.1)  # (even one heard since)
    assert _held(back, back, 0.6, 0.0)


def test_a_node_not_heard_since_the_return_is_held_as_long_as_the_cut_lasted():
    back, gap = 50.0, 8.0
    before = 40.0  # (last heard before the cut)
    assert _held(back + 1.7, back, gap, before)  # (the case met: declared)
    assert _held(back + gap + 2 * LEASE - 0.01, back, gap, before)
    assert not _held(back + gap + 2 * LEASE, back, gap, before)
    assert not _held(back + gap + 2 * LEASE, back, gap, 0.0)  # (never heard)


def test_a_node_heard_after_the_return_is_judged_as_usual_past_two_leases():
    back, gap = 50.0, 8.0
    assert not _held(back + 2 * LEASE, back, gap, back + 0.2)


class _Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_beats_record_the_own_gap_and_when_each_node_was_last_heard():
    auth = ValueAuth(JobSecret.draw())
    clock = _Clock()
    beats = Beats([], "job", 1, auth.sign, auth.verify, timeout_s=LEASE, clock=clock)

    def hear(node: int, counter: int) -> None:
        subject = beat_subject("job", node)
        beats._heard_msg(subject, encode(Beat(node, counter, {node: 1}), auth.sign, subject))

    hear(1, 1), hear(0, 1)
    clock.now = 10.1
    hear(1, 2)
    assert beats.back_at == 0.0  # (its own beats on time)
    assert beats.heard_at(0) == 10.0 and beats.heard_at(2) == 0.0
    clock.now = 18.5  # (cut off for 8.4 s)
    hear(1, 3)
    assert beats.back_at == 18.5 and abs(beats.back_gap - 8.4) < 1e-9
    assert beats.own_at() == 18.5
    clock.now = 18.6
    hear(0, 1)  # (a replayed counter moves nothing)
    assert beats.heard_at(0) == 10.0
    hear(0, 2)
    assert beats.heard_at(0) == 18.6
    forged = ValueAuth(JobSecret.draw())
    subject = beat_subject("job", 2)
    beats._heard_msg(subject, encode(Beat(2, 9), forged.sign, subject))
    assert beats.heard_at(2) == 0.0 and beats.forged == 1


def test_a_second_shorter_gap_does_not_cut_the_first_ones_hold_short_and_a_fence_holds():
    auth = ValueAuth(JobSecret.draw())
    clock = _Clock()
    beats = Beats([], "job", 1, auth.sign, auth.verify, timeout_s=LEASE, clock=clock)
    subject = beat_subject("job", 1)

    def own(counter: int) -> None:
        beats._heard_msg(subject, encode(Beat(1, counter), auth.sign, subject))

    own(1)
    clock.now = 18.0  # (back after 8 s: held until 18 + 8 + 2 leases)
    own(2)
    clock.now = 18.7  # (its own beats lost again for 0.7 s as its connections come back)
    own(3)
    assert beats.back_at == 18.7 and abs(beats.back_at + beats.back_gap - 26.0) < 1e-9
    end = beats.back_at + beats.back_gap + 2 * LEASE
    assert held_after_return(end - 0.01, end - 0.01, beats.back_at, beats.back_gap, 5.0, LEASE)
    fresh = Beats([], "job", 1, auth.sign, auth.verify, timeout_s=LEASE, clock=clock)
    clock.now = 40.05
    fresh.fenced()  # (its own mark read: it was declared lost)
    assert fresh.back_at == 40.05 and fresh.back_gap == LEASE
    assert held_after_return(40.05 + 2.3, 40.05 + 2.3, fresh.back_at, LEASE, 39.0, LEASE)
    assert not held_after_return(40.05 + 2.3, 40.05 + 2.3, fresh.back_at, LEASE, 40.1, LEASE)
