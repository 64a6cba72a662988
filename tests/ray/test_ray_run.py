"""``fastft ray run`` on a local two-node Ray cluster: the demo's model on 2 nodes x 2
workers; an exception, a worker SIGKILL and SIGSTOP, and a whole node agent actor killed
(with its workers) each recover, and the run ends bitwise equal to the fault-free one
(S5, a fixed world with the node's return); bad input ends at start with one line."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
from _rayruns import ray_run
from _runs import check_s1_s3, finals

from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def clean(cluster, tmp_path_factory):
    run = tmp_path_factory.mktemp("r") / "clean"
    p = ray_run(cluster, run)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    check_s1_s3(run, 40)
    (digest,) = {v["digest"] for v in finals(run).values()}
    assert len(finals(run)) == 4
    return digest


def test_each_worker_fault_recovers_on_the_cluster(cluster, clean, tmp_path):
    plan = [
        {"kind": "exception", "rank": 1, "at_step": 6},
        {"kind": "sigkill", "rank": 2, "at_step": 14},
        {"kind": "sigstop", "rank": 3, "at_step": 24},
    ]
    # (on node 0's TCPStore, the option for small jobs; the other runs on the NATS servers)
    p = ray_run(cluster, tmp_path / "faults", "--nats-servers", "0", plan=plan)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "faults"
    check_s1_s3(run, 40)
    assert {v["digest"] for v in finals(run).values()} == {clean}
    out = p.stdout
    assert "node 0's TCPStore" in out, out[:2000]
    assert "fastft: fault: rank 2.0 killed by SIGKILL; restarting it as life 1" in out, out
    assert "[rank 1.0]" in out  # (the workers' output, with its prefixes, on the driver)


def _actor_of(node: int) -> psutil.Process:
    """The Ray actor process that runs node ``node``'s agent."""
    for p in psutil.Process().children(recursive=True):
        try:
            line = p.cmdline()
        except psutil.Error:
            continue
        if (
            "fastft.cli" in line
            and "--node-rank" in line
            and line[line.index("--node-rank") + 1] == str(node)
            and "--standby" not in line  # (its standby's: not the node's agent yet)
        ):
            return p.parent()
    raise AssertionError(f"no agent of node {node}")


def _until_step(run, proc, step: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(e["event"] == "commit" and e["step"] >= step for e in read_events(run)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the job never reached step {step}")


def _until_said(run, proc, text: str) -> None:
    deadline = time.monotonic() + 120
    log = run.parent / f"{run.name}.log"
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and text in log.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"the driver never said {text!r}")


def _kill_mid_run(run, proc, victim, step: int = 8, said: str = "") -> tuple[str, float]:
    """Once the job committed ``step`` (and the driver said ``said``), SIGKILL
    ``victim()``; wait for the job, which must end 0. The driver's output and the moment
    of the kill."""
    try:
        if said:
            _until_said(run, proc, said)
        _until_step(run, proc, step)
        t_kill = time.monotonic()
        victim().send_signal(signal.SIGKILL)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    out = (run.parent / f"{run.name}.log").read_text()
    assert proc.returncode == 0, out[-4000:]
    return out, t_kill


def test_a_node_agent_actor_killed_is_taken_over_by_its_standby(cluster, clean, tmp_path):
    """Node 1's agent actor is SIGKILLed at step 8 (its agent and workers die with it):
    the driver tells node 1's standby to go; the dead workers are declared dead by it or,
    first, by a watcher of the node's lease (300 ms on NATS since its beats: about as
    fast as Ray says the actor died): the same two lives, by one or both; the new agent's workers
    join and heal; the run ends bitwise equal to the fault-free one."""
    run = tmp_path / "node"
    # (slow steps: the kill once the standby is warm, its torch imported on 2 busy cores)
    proc = ray_run(cluster, run, train=("--step-time", "0.4"), steps=40, wait=False)
    said = "node 1's standby agent is warm"
    out, _ = _kill_mid_run(run, proc, lambda: _actor_of(1), said=said)  # (+ agent, workers)
    assert "node 1's agent actor died; its standby agent takes the node over" in out, out[-4000:]
    check_s1_s3(run, 40)
    assert {v["digest"] for v in finals(run).values()} == {clean}
    ev = read_events(run)
    took = [e for e in ev if e["event"] == "node_taken_over" and e["node"] == 1]
    lost = [e for e in ev if e["event"] == "node_lost" and e["node"] == 1]
    assert [e["ranks"] for e in took + lost] in ([[2, 3]], [[2, 3], [2, 3]]), (took, lost)
    for rank in ("rank 2", "rank 3"):  # node 1's workers: started again by its new agent
        starts = [e for e in ev if e["event"] == "worker_start" and e["src"] == rank]
        assert len({e["incarnation"] for e in starts}) == 2, starts
        heals = [e for e in ev if e["event"] == "heal" and e["src"] == rank and e["step"] > 0]
        assert heals and heals[-1]["role"] == "fetch"  # ... and healed from a survivor


def test_an_elastic_world_goes_on_without_the_lost_node_and_takes_it_back(cluster, tmp_path):
    """Elastic (--min-replicas 2), no standby agents: node 1's agent actor is SIGKILLed
    at step 8; the survivors declare it lost by its lease and go on as a world of 2, the
    driver starts a new agent actor and its workers join at a later step. Every sample of
    every step is consumed once (S5 for an elastic world), and every member ends equal to
    one process training on the whole batch."""
    from test_runtime_faults import assert_equal_to_one_process

    from fastft.report import shards_by_step, unlogged_commits, untiled_steps

    run, steps = tmp_path / "elastic", 200
    proc = ray_run(
        cluster, run, "--min-replicas", "2", "--no-standby-agents", train=("--step-time", "0.05"),
        steps=steps, wait=False,
    )  # fmt: skip
    out, t_kill = _kill_mid_run(run, proc, lambda: _actor_of(1))
    assert "node 1's agent actor died; a new agent starts (restart 1 of 3)" in out, out[-4000:]
    ev = read_events(run)
    assert [e["node"] for e in ev if e["event"] == "node_lost"] == [1]
    check_s1_s3(run, steps)
    shards = shards_by_step([*ev, *unlogged_commits(ev)])
    assert sorted(shards) == list(range(steps)) and untiled_steps(shards) == []
    assert any(len(shards[s]) == 2 for s in shards), "the survivors never went on alone"
    back = [e for e in ev if e["event"] == "commit" and e["src"] == "rank 2" and e["mono"] > t_kill]
    assert back and len(shards[steps - 1]) == 4, "node 1's workers never joined again"
    assert_equal_to_one_process(run / "out", steps, 96, ranks=range(4))


def _nats_actor(index: int) -> psutil.Process:
    """The Ray actor process that runs the job's NATS server ``index``."""
    for p in psutil.Process().children(recursive=True):
        try:
            line = p.cmdline()
        except psutil.Error:
            continue
        if line and line[0].endswith("nats-server") and f"/nats/n{index}/" in line[-1]:
            return p.parent()
    raise AssertionError(f"no NATS server n{index}")


def test_a_nats_server_actor_killed_mid_training_the_job_goes_on(cluster, clean, tmp_path):
    run = tmp_path / "plane"
    proc = ray_run(cluster, run, train=("--step-time", "0.05"), steps=40, wait=False)
    out, _ = _kill_mid_run(run, proc, lambda: _nats_actor(1))  # (its nats-server too)
    url = out.split("store ")[1].split()[0].rstrip(",").split(",")[1]
    said = f"NATS server n1's actor died; Ray started it again at {url}\n"
    assert said in out, out[-4000:]  # (at the address the clients were given)
    check_s1_s3(run, 40)
    assert {v["digest"] for v in finals(run).values()} == {clean}
    ev = read_events(run)
    faults = [
        e
        for e in ev
        if e["event"] == "node_lost" or e["event"] == "worker_exit" and e["exit_code"] != 0
    ]
    assert not faults, f"the server's loss was taken for a fault: {faults}"
    assert max(e["step"] for e in ev if e["event"] == "commit") == 39


def test_two_nats_servers_fail_at_start(tmp_path):
    p = ray_run(type("C", (), {"address": "127.0.0.1:1"}), tmp_path / "two", "--nats-servers", "2")
    assert p.returncode == 2 and "--nats-servers 2: use 3" in p.stderr, p.stderr


def test_no_cluster_at_the_address_fails_at_start_with_one_line(tmp_path):
    from fastft.bus.natscluster import free_port

    class Nowhere:
        address = f"127.0.0.1:{free_port()}"

    t0 = time.monotonic()
    p = ray_run(Nowhere, tmp_path / "none")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no Ray cluster at" in p.stderr and time.monotonic() - t0 < 120


def test_too_few_resources_fail_at_start_and_leave_nothing(cluster, tmp_path):
    p = ray_run(cluster, tmp_path / "big", "--cpus-per-node", "100")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "the cluster has" in p.stderr and "CPU" in p.stderr


def test_a_script_that_fails_to_import_ends_the_job_with_its_error(cluster, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fastft.cli", "ray", "run", "--address", cluster.address]
    cmd += ["--nodes", "2", "--nproc", "1", "--run-dir", str(tmp_path / "run"), str(bad)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode not in (0, None), p.stdout[-2000:]
    assert "no_such_module_here" in p.stdout, p.stdout[-3000:]


def test_the_python_entry_point_runs_the_job(cluster, tmp_path):
    import subprocess
    import sys

    run = tmp_path / "py"
    code = (
        "import sys, fastft.ray\n"
        "argv = ['--check-every', '1', '-m', 'fastft.demo.train', '--', '--steps', '12',\n"
        f"        '--out', {str(run / 'out')!r}]\n"
        f"sys.exit(fastft.ray.run(argv, nodes=2, nproc=2, address={cluster.address!r},\n"
        f"                        run_dir={str(run)!r}, nats_servers=0))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(finals(run)) == [0, 1, 2, 3]  # (2 nodes x the nproc given)
    check_s1_s3(run, 12)
