"""Nobody outside the job can steer it (issue 21): a process that reaches the job's store
and knows its id, but not its secret, forges faults, injections, rollback requests and
decisions into a running 3-worker job. Nothing is acted on; the job's result is the clean
run's. And a single-node job listens on loopback alone."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _runs import STEPS, check_s1_s3, finals

from fastft.bus import BusConfig, connect_store, tcpstore_bus
from fastft.protocol import Fault, Inject, JobKeys, Role, RollbackRequest, Severity
from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(240)

JOB = "forged"


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of ``pid`` and its descendants."""
    out = set()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _forge(store, keys: JobKeys, bus, round_: int) -> None:
    stranger = dict(job=JOB, epoch=1, rank=-1, incarnation=4242, role=Role.OPERATOR)
    for r in range(3):
        bus.broadcast(Inject(**stranger, target_rank=r, fault_kind="sigkill", at_step=-1, arg=0.0))
    bus.broadcast(
        Fault(**stranger, severity=Severity.FAULT1, cause="forged", faulty_rank=round_ % 3)
    )
    bus.broadcast(
        RollbackRequest(job=JOB, epoch=1, rank=2, incarnation=1, step=round_, reason="forged")
    )


@pytest.fixture(scope="module")
def forged_run(tmp_path_factory) -> tuple[Path, set[tuple[str, int]]]:
    run = tmp_path_factory.mktemp("sec") / JOB
    run.mkdir()
    cmd = [
        *(sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)),
        *("--check-every", "1", "--job", JOB, "--bus-relay", "on"),
        *("-m", "fastft.demo.train", "--"),
        *("--steps", str(STEPS), "--out", str(run / "out"), "--step-time", "0.05"),
    ]
    log_path = run / "launcher.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    listening: set[tuple[str, int]] = set()
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            assert time.monotonic() < deadline and p.poll() is None, log_path.read_text()
            m = re.search(r"store 127\.0\.0\.1:(\d+) \(listening\)", log_path.read_text())
            port = int(m.group(1)) if m else None
            time.sleep(0.02)
        store = connect_store(f"127.0.0.1:{port}")
        keys = JobKeys(JOB)
        # every decision of the first epochs pre-empted with a rollback
        for epoch in (1, 2, 3):
            for step in range(STEPS):
                store.compare_set(keys.decision(epoch, step), "", f"Rforged {epoch}/{step}")
        store.compare_set(keys.finished, "", "0")
        bus = tcpstore_bus(
            store,
            BusConfig(job=JOB, rank=-1, incarnation=4242, role=Role.OPERATOR, subscribe=False),
        ).start()
        i = 0
        while p.poll() is None and time.monotonic() < deadline + 120:
            try:
                _forge(store, keys, bus, i)
            except Exception:  # noqa: BLE001 - the job ended, and its store with it
                if p.wait(timeout=30) is None:
                    raise
                break
            listening |= _listening(p.pid)
            i += 1
            time.sleep(0.05)
        bus._closed.set()  # (its store may be gone: nothing to leave)
        assert p.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return run, listening


def test_forged_faults_injections_and_decisions_change_nothing(forged_run, clean):
    run, _ = forged_run
    ev = read_events(run)
    acted = {"rollback", "propose_rollback", "injected", "peer_fault", "interrupt"}
    acted |= {"declare_dead", "worker_stopped", "job_finished"}
    assert not acted & {e["event"] for e in ev}, [e for e in ev if e["event"] in acted]
    exits = [e for e in ev if e["event"] == "worker_exit"]
    assert len(exits) == 3 and all(e.get("exit_code") == 0 for e in exits), exits
    (stop,) = [e for e in ev if e["event"] == "agent_stop"]
    assert stop["restarts"] == 0
    # the workers heard the bus through their agent's relay (in every tier: --bus-relay on),
    # which passed the forged frames on as they were: each worker checked them itself
    assert stop["relay"]["accepted"] == 3 and stop["relay"]["frames"] > 0, stop
    check_s1_s3(run)
    f = finals(run)
    assert {v["digest"] for v in f.values()} == {v["digest"] for v in clean.values()}
    stops = [e for e in ev if e["event"] == "worker_stop"]
    assert len(stops) == 3
    for s in stops:  # the counters: every worker dropped the forged frames
        assert s["rejected"]["forged"] > 0, s
        assert s["rejected"]["by_sender"].get("rank -1 incarnation 4242 operator", 0) > 0, s
    assert sum(s["rejected"]["forged_values"] for s in stops) > 0
    log = (run / "launcher.log").read_text()
    assert "dropped a frame that claims to be from rank -1 incarnation 4242 operator" in log
    assert "without the job secret's tag" in log


def test_a_single_node_job_listens_on_loopback_alone(forged_run):
    _, listening = forged_run
    assert listening, "no listening socket seen (the store at least listens)"
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}, sorted(listening)
