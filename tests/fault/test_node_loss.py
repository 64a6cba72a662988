"""A node lost whole, with the TCPStore and the NATS control planes: 3 nodes on this machine, one worker
each (a node is an agent and its workers in a process group of their own; it is lost by
SIGKILL of the group, partitioned by SIGSTOP of the group). Nobody's parent sees the lost
workers die: the other agents see the node's lease run out and declare its workers dead
(Fault1). Each run is held to S1 and S3 (every step committed once, members agree) and to
S5 against a fault-free run."""

from __future__ import annotations

import os
import signal
import time

import pytest
from _nodes import Nodes
from _runs import check_s1_s3, finals
from test_runtime_faults import assert_equal_to_one_process

from fastft.report import shards_by_step, unlogged_commits, untiled_steps

pytestmark = pytest.mark.timeout(240)

STEPS = 30
SLOW_STEPS = ("--step-time", "0.06")  # steps long enough for a loss in the middle


def lost_events(ev: list[dict], node: int) -> list[dict]:
    return [e for e in ev if e["event"] == "node_lost" and e["node"] == node]


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory):
    from fastft.bus.natscluster import LocalCluster

    with LocalCluster(tmp_path_factory.mktemp("nats"), servers=3) as c:
        yield c


def beats(plane: str) -> tuple[str, ...]:
    """``tcpstore-peers``: a TCPStore job whose agents beat to each other (issue 64; the
    default above 256 nodes)."""
    return ("--node-beats", "peers") if plane == "tcpstore-peers" else ()


def control(cluster, plane: str) -> str | None:
    """The ``--control`` value of ``plane``: None (TCPStore, hosted by node 0's agent) or
    the module's 3-server NATS cluster (a fixture of every test that may use it: started
    before the test, so that the test's leftover check does not count its servers)."""
    return cluster.address if plane == "nats" else None


@pytest.mark.parametrize(
    "plane, lost",
    # (NATS: in the slow tier, to keep make test under its 10 minutes on 2 cores)
    [
        ("tcpstore", 2),
        pytest.param("tcpstore-peers", 2, marks=pytest.mark.slow),
        pytest.param("nats", 0, marks=pytest.mark.slow),
    ],
)
def test_a_lost_node_is_declared_dead_and_the_elastic_world_goes_on(
    tmp_path, nats_cluster, plane, lost
):
    """Elastic world (--min-replicas 2): a node is SIGKILLed whole at step 8 and never
    returns (with NATS, node 0: it hosts nothing there). An agent declares it lost once
    its lease runs out, the survivors go on without it, every sample is consumed once,
    and the result equals one process training on the whole batch."""
    steps, batch = 40, 96
    job = Nodes(
        tmp_path / "elastic",
        3,
        flags=("--min-replicas", "2", *beats(plane)),
        steps=steps,
        train=("--batch", str(batch), *SLOW_STEPS),
        control=control(nats_cluster, plane),
    )
    survivors = [n for n in range(3) if n != lost]
    try:
        job.start_all()
        job.wait_commit(8)
        job.signal(lost, signal.SIGKILL)
        codes = job.wait(150)
        assert codes == {lost: -signal.SIGKILL, **{n: 0 for n in survivors}}, job.logs()
    finally:
        assert job.close() in ([], [job.agent(lost).pid]), job.logs()
    ev = job.events()
    how = {e["beats"] for e in ev if e["event"] == "node_lease"}
    assert how == {{"nats": "nats", "tcpstore": "store"}.get(plane, "peers")}, how
    # declared by one agent (with NATS by one or both of the node's two lease watchers, on
    # the same lease: one verdict, as tests/net's NATS cut)
    verdicts = lost_events(ev, lost)
    assert 1 <= len(verdicts) <= (2 if plane == "nats" else 1), verdicts
    assert len({(e["lease"], e["lives"]) for e in verdicts}) == 1, verdicts
    declared = verdicts[0]
    assert declared["src"] in [f"agent {n}" for n in survivors] and declared["lives"] == 1
    assert not [e for e in ev if e["event"] == "store_lost"]
    check_s1_s3(job.run, steps=steps)
    shards = shards_by_step([*ev, *unlogged_commits(ev)])  # (+ voted, then died)
    assert sorted(shards) == list(range(steps)) and untiled_steps(shards) == []
    two = min(s for s, parts in shards.items() if len(parts) == 2)  # without the lost node
    assert two >= 8 and all(len(shards[s]) == 2 for s in range(two, steps))
    assert_equal_to_one_process(job.run / "out", steps, batch, ranks=survivors)


@pytest.mark.slow  # (the slow tier keeps make test under its 10 minutes)
def test_a_lost_node_that_is_started_again_heals_in_a_fixed_world(tmp_path, clean):
    """Fixed world: node 1 is SIGKILLed whole; the survivors wait for its worker, which
    nobody restarts until the node's agent is started again (as a scheduler would). Its
    new worker heals from a live peer, and the result is bitwise equal to a clean run."""
    job = Nodes(tmp_path / "fixed", 3, steps=STEPS, train=SLOW_STEPS)
    try:
        job.start_all()
        job.wait_commit(8)
        job.signal(1, signal.SIGKILL)
        job.wait_event(lambda e: e["event"] == "node_lost" and e["node"] == 1, 30)
        job.start(1)
        codes = job.wait(150)
        assert codes == {0: 0, 1: 0, 2: 0}, job.logs()
    finally:
        assert job.close() == [], job.logs()
    ev = job.events()
    assert len(lost_events(ev, 1)) == 1
    assert any(e["event"] == "heal" and e["src"] == "rank 1" for e in ev)
    check_s1_s3(job.run, steps=STEPS)
    got = finals(job.run)
    assert sorted(got) == [0, 1, 2]
    assert {v["digest"] for v in got.values()} == {clean[0]["digest"]}


def test_a_standby_takes_a_lost_node_over_at_once_and_heals_it(tmp_path, clean):
    """Fixed world: node 1's standby (``fastft run --standby``) waits warm beside it; node 1
    is SIGKILLed whole and the standby told to go at once (what ``fastft ray run``'s driver
    does when the agent actor dies). It declares the dead agent's worker dead itself (no
    lease runs out: nobody declares the node lost), its worker joins and heals, and the
    result is bitwise equal to a clean run; a standby never told to go exits 0."""
    # (0.3 s steps: the standby warms up, torch imported on 2 cores busy with the job)
    job = Nodes(tmp_path / "standby", 3, steps=STEPS, train=("--step-time", "0.3"))
    try:
        job.start_all()
        job.start(1, standby=True)
        spare = job.start(2, standby=True)  # (not needed: its stdin closed at the end)
        log = job.run / "node1-1-standby.log"
        deadline = time.monotonic() + 60
        while "standby agent of node 1 warm" not in log.read_text():
            assert time.monotonic() < deadline and job.standbys[1].poll() is None, job.logs()
            time.sleep(0.05)
        job.wait_commit(8)
        waiting = log.read_text()  # (nothing of the job: no store, lease or event yet)
        assert job.standbys[1].poll() is None and "fastft: job" not in waiting, waiting
        job.signal(1, signal.SIGKILL)
        job.go(1)
        codes = job.wait(150)
        assert codes == {0: 0, 1: 0, 2: 0}, job.logs()
        assert spare.stdin is not None
        spare.stdin.close()
        assert spare.wait(30) == 0, job.logs()
        job.standbys.pop(2)
    finally:
        assert job.close() in ([], [job.procs[1][0].pid]), job.logs()
    ev = job.events()
    assert lost_events(ev, 1) == [], job.logs()  # (taken over before any lease ran out)
    (took,) = [e for e in ev if e["event"] == "node_taken_over"]
    assert took["node"] == 1 and took["ranks"] == [1], took
    assert any(e["event"] == "heal" and e["src"] == "rank 1" for e in ev)
    check_s1_s3(job.run, steps=STEPS)
    got = finals(job.run)
    assert sorted(got) == [0, 1, 2]
    assert {v["digest"] for v in got.values()} == {clean[0]["digest"]}


def test_losing_the_store_host_ends_the_job_with_one_clear_line(tmp_path):
    """With the TCPStore control plane, node 0 hosts the store: its loss ends the job.
    The other agents say so in one line and exit non-zero within the lease timeout, and
    leave no process behind."""
    job = Nodes(tmp_path / "host", 3, steps=400, train=SLOW_STEPS)
    try:
        job.start_all()
        job.wait_commit(5)
        t0 = time.monotonic()
        job.signal(0, signal.SIGKILL)
        codes = job.wait(60)
        took = time.monotonic() - t0
        assert codes[1] not in (None, 0) and codes[2] not in (None, 0), (codes, job.logs())
        assert took < 30, took  # not a hang: the lease (300 ms) plus the workers' teardown
        for n in (1, 2):
            log = (job.run / f"node{n}-0.log").read_text()
            assert "the store host is gone" in log, log[-2000:]
        deadline = time.monotonic() + 10  # the workers the agents killed are reaped
        while job.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = job.leftovers()
        assert left == [], job.describe(left)
    finally:
        job.close()


@pytest.mark.parametrize(
    "plane, node",
    # (the slow tier, to keep make test under its 10 minutes on 2 cores)
    [
        pytest.param("tcpstore", 2, marks=pytest.mark.slow),
        pytest.param("tcpstore-peers", 2, marks=pytest.mark.slow),
        pytest.param("nats", 1, marks=pytest.mark.slow),
    ],
)
def test_a_partitioned_node_is_fenced_and_heals(tmp_path, clean, nats_cluster, plane, node):
    """A node is stopped whole (a partition): declared lost after its lease, its worker is
    dead to the job. When it comes back a second later, its agent finds the mark, kills
    the stale worker and starts it again as a new incarnation, which heals; the result is
    bitwise equal to a clean run."""
    job = Nodes(
        tmp_path / "partition",
        3,
        steps=STEPS,
        flags=beats(plane),
        train=SLOW_STEPS,
        control=control(nats_cluster, plane),
    )
    try:
        job.start_all()
        job.wait_commit(8)
        job.signal(node, signal.SIGSTOP)
        job.wait_event(lambda e: e["event"] == "node_lost" and e["node"] == node, 30)
        time.sleep(1.0)
        job.signal(node, signal.SIGCONT)
        codes = job.wait(150)
        assert codes == {0: 0, 1: 0, 2: 0}, job.logs()
    finally:
        assert job.close() == [], job.logs()
    ev = job.events()
    assert {e["beats"] for e in ev if e["event"] == "node_lease"} == {
        {"nats": "nats", "tcpstore": "store"}.get(plane, "peers")
    }
    assert len(lost_events(ev, node)) == 1
    assert [e for e in ev if e["event"] == "node_fenced" and e["src"] == f"agent {node}"]
    assert any(e["event"] == "heal" and e["src"] == f"rank {node}" for e in ev)
    check_s1_s3(job.run, steps=STEPS)
    assert {v["digest"] for v in finals(job.run).values()} == {clean[0]["digest"]}


def test_slow_steps_across_nodes_confirm_each_commit_in_the_store_and_stay_equal(tmp_path, clean):
    """Steps slower than the shortest node silence a watcher may declare (the lease less one
    renewal: 400 ms here, so 300 ms after the last commit): each commit decided by the
    gradients' allreduce is confirmed in the store first (a member cut off meanwhile would
    find the others' rollback there; docs/architecture.md, *A late completion is
    confirmed*). Fault-free, every step of every member is confirmed as a commit, nothing
    rolls back, and the run ends bitwise equal to the clean one."""
    job = Nodes(tmp_path / "slow", 3, steps=STEPS, train=("--step-time", "0.35"))
    try:
        job.start_all()
        codes = job.wait(150)
        assert codes == {0: 0, 1: 0, 2: 0}, job.logs()
    finally:
        assert job.close() == [], job.logs()
    ev = job.events()
    # (``make test-store-vote``: every step decided in the store, none by its collective,
    # so none confirmed)
    in_store = os.environ.get("FASTFT_DECIDE") == "store"
    for r in range(3):
        confirmed = [e for e in ev if e["event"] == "vote_confirmed" and e["src"] == f"rank {r}"]
        commits = [e["step"] for e in ev if e["event"] == "commit" and e["src"] == f"rank {r}"]
        assert commits == list(range(STEPS)), commits
        if in_store:
            assert confirmed == []
            continue
        assert {e["decision"] for e in confirmed} == {"C"}, confirmed
        assert sorted(e["step"] for e in confirmed) == commits
    assert not [e for e in ev if e["event"] in ("rollback", "node_lost")], job.logs()
    check_s1_s3(job.run, steps=STEPS)
    assert {v["digest"] for v in finals(job.run).values()} == {clean[0]["digest"]}


# --- losing NATS servers --------------------------------------------------------------------
@pytest.mark.slow
def test_with_nats_losing_a_server_then_another_stalls_but_loses_nothing(tmp_path, clean):
    """The server that leads the control plane's bucket is SIGKILLed mid-training; once it
    is back, the new leader is too. Each costs a leader election (a stall of seconds), no
    worker and no step: nobody is declared lost, nothing restarts, and the result is
    bitwise equal to a clean run."""
    from fastft.bus.natscluster import LocalCluster

    with LocalCluster(tmp_path / "nats", servers=3) as c:
        job = Nodes(
            tmp_path / "nats-servers", 3, steps=STEPS, train=("--step-time", "0.25"),
            control=c.address,
        )  # fmt: skip
        try:
            job.start_all()
            job.wait_commit(4)
            first = c.leader(wait_s=30)
            assert first is not None
            c.kill(first)
            job.wait_commit(10, timeout=60)
            c.start_server(first)
            c.wait_ready(30)
            second = c.leader(wait_s=30)  # (its election may be under way: seen once)
            assert second is not None and second != first
            c.kill(second)
            codes = job.wait(150)
            assert codes == {0: 0, 1: 0, 2: 0}, job.logs()
        finally:
            assert job.close() == [], job.logs()
    ev = job.events()
    assert not [e for e in ev if e["event"] in ("node_lost", "store_lost", "rollback")]
    assert [e["restarts"] for e in ev if e["event"] == "agent_stop"] == [0, 0, 0]
    check_s1_s3(job.run, steps=STEPS)
    assert {v["digest"] for v in finals(job.run).values()} == {clean[0]["digest"]}


def _plan(run, faults: list[dict]) -> tuple[str, str]:
    import json

    run.mkdir(parents=True, exist_ok=True)
    (run / "plan.json").write_text(json.dumps({"faults": faults}))
    return ("--inject", str(run / "plan.json"))


@pytest.mark.slow
def test_a_node_that_fails_the_job_ends_every_node_with_its_reason(tmp_path):
    """Fixed world, 2 nodes: rank 1 (node 1) dies in both of its lives and has no restart
    left, so node 1's agent fails the job. Node 0 must not wait for a rank nobody will
    start again: it reads the failure in its next lease round, stops its worker, says why
    and exits 1 too."""
    run = tmp_path / "fails"
    kills = [{"kind": "sigkill", "rank": 1, "at_step": 5, "life": life} for life in (0, 1)]
    job = Nodes(run, 2, steps=200, flags=("--max-restarts", "1", *_plan(run, kills)))
    try:
        job.start_all()
        codes = job.wait(120)
        assert codes == {0: 1, 1: 1}, (codes, job.logs())
        log0 = (run / "node0-0.log").read_text()
        assert "the job failed on another node: node 1: rank 1 failed" in log0, log0[-2000:]
        assert "no restarts left (--max-restarts 1)" in log0, log0[-2000:]
    finally:
        assert job.close() == [], job.logs()
    ev = job.events()
    assert [e["src"] for e in ev if e["event"] == "job_failed_elsewhere"] == ["agent 0"]
    check_s1_s3(run, steps=1 + max(e["step"] for e in ev if e["event"] == "commit"))


@pytest.mark.slow
def test_an_elastic_world_drained_below_its_floor_across_nodes_fails(tmp_path):
    """Elastic, 3 nodes of one worker, --min-replicas 2: rank 1 (node 1) and then rank 2
    (node 2) drain for good. No agent sees another's slots, so the job counts the slots
    gone in the store: the second drain leaves one worker of three, below the floor for
    good, and the job fails at once with the reason on every node still running, instead
    of rank 0 waiting below the floor forever."""
    run = tmp_path / "floor"
    plan = _plan(
        run,
        [
            {"kind": "sigterm", "rank": 1, "at_step": 8},
            {"kind": "sigterm", "rank": 2, "at_step": 16},
        ],
    )
    job = Nodes(run, 3, steps=400, flags=("--min-replicas", "2", *plan), train=SLOW_STEPS)
    try:
        job.start_all()
        codes = job.wait(120)
        # node 1 ended cleanly (its only rank drained) before the floor was crossed
        assert codes == {0: 1, 1: 0, 2: 1}, (codes, job.logs())
        for n in (0, 2):
            log = (run / f"node{n}-0.log").read_text()
            assert "fell below --min-replicas 2 for good: 1 of 3 workers left" in log, log[-2000:]
    finally:
        assert job.close() == [], job.logs()
    mine = [e["step"] for e in job.events() if e["event"] == "commit" and e["src"] == "rank 0"]
    assert mine == list(range(len(mine))) and len(mine) >= 17


@pytest.mark.slow
@pytest.mark.parametrize("returns", [False, True], ids=["never-back", "started-again"])
def test_a_fixed_world_waits_for_a_drained_node_then_fails_saying_why(tmp_path, returns):
    """Fixed world, 2 nodes: node 1 is preempted (SIGTERM: its agent drains its worker and
    ends, 143). Node 0 cannot go on without it: it says so, waits ``--store-wait`` for the
    node's agent to start again, and fails the job with the reason (it waited for ever,
    saying nothing: found by issue 63's simulator). Started again within the wait, the
    node's new worker joins and heals, and every member ends with the same state."""
    run = tmp_path / ("back" if returns else "gone")
    job = Nodes(run, 2, steps=STEPS, flags=("--store-wait", "20" if returns else "3"),
                train=SLOW_STEPS)  # fmt: skip
    try:
        job.start_all()
        job.wait_commit(8)
        job.signal(1, signal.SIGTERM)
        job.wait_event(lambda e: e["event"] == "node_left" and e["node"] == 1, 30)
        assert job.agent(1).wait(30) == 143
        if returns:
            job.start(1)
        codes = job.wait(120)
        log0 = (run / "node0-0.log").read_text()
        assert "node 1 left the job before it finished" in log0, log0[-2000:]
        if returns:
            assert codes == {0: 0, 1: 0}, job.logs()
            assert "node 1's agent started again" in log0, log0[-2000:]
        else:
            assert codes[0] == 1, job.logs()
            assert "did not start again within 3 s (--store-wait)" in log0, log0[-2000:]
    finally:
        assert job.close() == [], job.logs()
    if returns:
        check_s1_s3(job.run, steps=STEPS)
        got = finals(job.run)
        assert sorted(got) == [0, 1] and len({v["digest"] for v in got.values()}) == 1
