"""Pipeline stages' flow store (fastft.runtime.groups.flow): the staleness bound's arithmetic, a
hold that a fault cancels at once, activations that arrive only once their step is
committed upstream, forged values ignored, and the refused configurations."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastft.bus import host_store
from fastft.errors import ConfigError
from fastft.interrupt import StepInterrupted
from fastft.protocol.auth import JobSecret
from fastft.runtime.contract import check_stage
from fastft.runtime.groups.flow import Flow, entry_needs

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def flow_store():
    server = host_store("127.0.0.1", 0)
    yield f"127.0.0.1:{server.port}"
    del server


def _stages(addr: str, secret: JobSecret, max_ahead: int = 2) -> tuple[Flow, Flow]:
    up = Flow(addr, "p", 0, 2, max_ahead, secret, world=2)
    down = Flow(addr, "p", 1, 2, max_ahead, secret, world=2)
    return up, down


def test_a_stage_enters_a_step_only_within_max_ahead_of_the_next():
    assert [entry_needs(s, 2) for s in range(5)] == [0, 0, 1, 2, 3]
    assert [entry_needs(s, 1) for s in range(3)] == [0, 1, 2]


def test_the_hold_waits_for_the_downstream_commit_and_a_fault_cancels_it(flow_store):
    up, down = _stages(flow_store, JobSecret.draw())
    assert up.hold(1, lambda: False) == 0.0  # within the bound: no wait
    assert down.hold(7, lambda: False) == 0.0  # the last stage is never held
    fault = threading.Event()
    threading.Timer(0.05, fault.set).start()
    t0 = time.monotonic()
    assert up.hold(2, fault.is_set) is None  # nothing committed downstream: held, then a fault
    assert time.monotonic() - t0 < 5  # (not the store's timeout: the fault ended it)
    threading.Timer(0.05, down.committed, args=(1,)).start()
    held = up.hold(2, lambda: False)
    assert held is not None and held > 0


def test_activations_arrive_once_their_step_is_committed_upstream(flow_store):
    up, down = _stages(flow_store, JobSecret.draw())
    h = torch.randn(3, 4)
    up.send(5, 1, h)
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.append(down.recv(5, 1, lambda: None)))
    t.start()
    time.sleep(0.1)
    assert not got  # sent, but step 5 is not committed upstream yet
    up.committed(6)
    t.join(10)
    assert torch.equal(got[0], h)

    def interrupted() -> None:
        raise StepInterrupted("a peer died", epoch=1, step=9)

    with pytest.raises(StepInterrupted):
        down.recv(9, 1, interrupted)


def test_a_value_without_the_jobs_tag_is_ignored_and_counted(flow_store):
    up, _ = _stages(flow_store, JobSecret.draw())
    _, other = _stages(flow_store, JobSecret.draw())  # another secret: a forger
    other.committed(1)
    fault = threading.Event()
    threading.Timer(0.1, fault.set).start()
    assert up.hold(2, fault.is_set) is None  # the forged commit did not release it
    assert up.forged >= 1


def test_stages_of_different_sizes_are_refused_at_the_first_receive(flow_store):
    secret = JobSecret.draw()
    Flow(flow_store, "q", 0, 2, 1, secret, world=3)
    down = Flow(flow_store, "q", 1, 2, 1, secret, world=2)
    with pytest.raises(ConfigError, match="same --nproc"):
        down.recv(0, 0, lambda: None)


@pytest.mark.parametrize(
    ("stage", "flow", "ahead", "elastic", "k", "match"),
    [
        ("2/2", "h:1", 1, False, 1, "use I/S"),
        ("x", "h:1", 1, False, 1, "use I/S"),
        ("0/2", None, 1, False, 1, "without --flow"),
        ("0/2", "h:1", 0, False, 1, "--max-ahead 0"),
        ("0/2", "h:1", 1, True, 1, "min-replicas"),
        ("0/2", "h:1", 1, False, 2, "shard-size"),
        (None, "h:1", 1, False, 1, "without --stage"),
    ],
)
def test_bad_stage_configurations_say_what_to_fix(stage, flow, ahead, elastic, k, match):
    with pytest.raises(ConfigError, match=match):
        check_stage(stage, flow, ahead, elastic, k)
    assert check_stage("1/3", "h:1", 2, False, 1) == (1, 3)
