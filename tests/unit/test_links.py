"""Slow links found by probing (issue 50): who is named from the probe times, when a
round is asked for, and the probe itself against its server."""

from __future__ import annotations

import socket
import threading

import pytest

from fastft.launch.gray.links import _serve, probe
from fastft.launch.rules.linkjudge import (
    FAILED_S,
    PROBE_BYTES,
    Broken,
    Slowdown,
    broken_pairs,
    probe_targets,
    slow_links,
    stuck,
)


def test_each_node_probes_its_next_nodes_around_the_ring() -> None:
    assert probe_targets(0, 5) == [1, 2]
    assert probe_targets(4, 5) == [0, 1]
    assert probe_targets(1, 2) == [0]  # (fewer nodes than the ring's width)


def ring_times(nnodes: int, slow: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    times = {(n, t): 0.003 for n in range(nnodes) for t in probe_targets(n, nnodes)}
    times.update(slow)
    return times


def test_a_node_whose_every_send_is_slow_is_named_by_its_direction() -> None:
    # node 2's egress throttled (tc tbf on its link): 2->3, 2->4 slow; 0->2, 1->2 not
    times = ring_times(5, {(2, 3): 0.4, (2, 4): 0.5})
    (link,) = slow_links(times, 1.3)
    assert (link.node, link.direction) == (2, "sends")
    assert link.ratio > 100 and link.others_s == pytest.approx(0.003)
    # its ingress instead: 0->2 and 1->2 slow
    (link,) = slow_links(ring_times(5, {(0, 2): 0.4, (1, 2): 0.3}), 1.3)
    assert (link.node, link.direction) == (2, "receives")
    # both (a shaper on its egress holds its TCP acks back too): one link, both ways
    both = ring_times(5, {(0, 2): 0.4, (1, 2): 0.3, (2, 3): 0.4, (2, 4): 0.5})
    (link,) = slow_links(both, 1.3)
    assert (link.node, link.direction, link.seconds) == (2, "both ways", 0.45)


def test_one_slow_pair_names_no_node_nor_does_noise_or_two_nodes() -> None:
    assert slow_links(ring_times(5, {(2, 3): 0.4}), 1.3) == []  # 2->4 fast: not 2's link
    assert slow_links(ring_times(5, {(2, 3): 0.010, (2, 4): 0.012}), 1.3) == []  # < 20 ms
    assert slow_links({(0, 1): 0.5, (1, 0): 0.003}, 1.3) == []  # every pair has both


def test_three_nodes_name_the_throttled_one() -> None:
    times = ring_times(3, {(2, 0): 0.6, (2, 1): 0.6})
    assert [(x.node, x.direction) for x in slow_links(times, 1.3)] == [(2, "sends")]


def test_a_slowdown_in_the_same_world_asks_for_a_probe() -> None:
    watch = Slowdown(1.3)
    steps = {0: 0.05, 1: 0.05, 2: 0.05}  # rank -> its recent step time
    assert watch.update(steps) is None  # the baseline
    assert watch.update({r: 0.06 for r in steps}) is None  # within the factor
    assert watch.update({0: 0.2, 1: 0.0, 2: 0.2}) is None  # one not known yet
    assert watch.update({r: 0.012 for r in steps}) is None  # faster: the new baseline
    why = watch.update({r: 0.048 for r in steps})
    assert why is not None and "4.0x" in why and "12 ms" in why
    assert Slowdown(1.3).update({r: 0.0101 for r in steps}) is None
    tiny = Slowdown(1.3)
    tiny.update({r: 0.001 for r in steps})
    assert tiny.update({r: 0.005 for r in steps}) is None  # 5x, but 4 ms: noise
    # a new world starts a new baseline
    watch = Slowdown(1.3)
    watch.update(steps)
    assert watch.update({0: 0.2, 1: 0.2}) is None


def test_a_probe_is_timed_until_its_server_acknowledges() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve, args=(sock,), daemon=True).start()
    try:
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
        t = probe(addr, PROBE_BYTES, timeout_s=3.0)
        assert 0 < t < 1.0
        closed = socket.create_server(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        assert probe(f"127.0.0.1:{port}", timeout_s=0.5) == FAILED_S  # nothing listens
    finally:
        sock.close()


def test_a_broken_pair_takes_out_one_of_its_nodes_never_a_whole_cut() -> None:
    dead = FAILED_S
    times = ring_times(3, {(2, 1): dead, (1, 2): dead})  # a route 2 -> 1 blackholed
    assert broken_pairs(times) == Broken(2, ((1, 2), (2, 1)))  # a tie: the higher node
    times = ring_times(3, {(1, 0): dead, (0, 1): dead})
    assert broken_pairs(times) == Broken(1, ((0, 1), (1, 0)))  # never node 0 if avoidable
    assert broken_pairs(ring_times(3, {})) is None
    cut = ring_times(3, {(2, 0): dead, (2, 1): dead, (0, 2): dead, (1, 2): dead})
    assert broken_pairs(cut) is None  # node 2 cut off whole: the lease's business
    mid = ring_times(3, {(0, 2): dead, (1, 2): dead})  # cut after it sent its own probes
    assert broken_pairs(mid) is None
    assert slow_links(mid, 1.3) == []  # (a failed probe is no slowness)
    # every member alive and waiting 20 step times (2 s at least): stuck
    assert stuck({0: (0.05, 2.5), 1: (0.05, 2.2)}) is not None
    assert stuck({0: (0.05, 2.5), 1: (0.05, 0.0)}) is None  # one computes
    assert stuck({0: (0.5, 5.0), 1: (0.5, 5.0)}) is None  # 10 steps of 0.5 s
    assert stuck({0: (0.05, 9.0)}) is None  # one member: nothing between members
