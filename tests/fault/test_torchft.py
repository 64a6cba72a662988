"""ManagerFFT inside torchft, end to end, in the style of torchft's own integration tests:
3 replicas on CPU with Gloo and a real lighthouse on a port the OS chose, started by
``fastft run --torchft fastft`` around the unchanged example script. One replica is
SIGKILLed, raises, is SIGSTOPped or hangs *inside* the gradient allreduce; the survivors go on
in a quorum without it, the restarted replica heals from a live peer, and every replica
ends at the same step with the same parameters. A replica hung while holding the GIL is
found by the agent's hang timeout (by the worker's pace)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastft.bus.natscluster import free_port
from fastft.integrations.torchft.quorum import parse_replica_id
from fastft.report import summarize
from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(150)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchft_ddp.py"
STEPS = 120
FAULT_STEP = 30


def run_example(tmp: Path, kind: str) -> tuple[Path, str]:
    run = tmp / kind
    run.mkdir(parents=True)
    fault = {"kind": kind, "rank": 1, "at_step": FAULT_STEP, "point": "collective"}
    if kind == "gil_hang":
        fault["arg"] = 600  # holds the GIL until the agent kills it
    plan = {"faults": [fault]}
    (run / "plan.json").write_text(json.dumps(plan))
    cmd = [
        sys.executable, "-m", "fastft.cli", "run", "--torchft", "fastft", "--nproc", "3",
        "--warm-spares", "1", "--job", kind, "--run-dir", str(run),
        "--inject", str(run / "plan.json"), str(EXAMPLE), "--steps", str(STEPS),
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=130)
    out = p.stdout + p.stderr
    (run / "launcher.log").write_text(out)
    assert p.returncode == 0, out[-3000:]
    return run, out


@pytest.mark.slow  # (~25 s each: the slow tier keeps make test under its 10 minutes)
@pytest.mark.parametrize("kind", ["sigkill", "exception", "sigstop", "gil_hang"])
def test_replica_fault_inside_allreduce(tmp_path: Path, kind: str) -> None:
    run, out = run_example(tmp_path, kind)
    ev = read_events(run)

    # Every replica (the restarted one included) finished every step, with equal state.
    # (output lines of the replicas may interleave: match the 16-digit digest exactly)
    finals = re.findall(r"replica (\d) step (\d+) digest ([0-9a-f]{16})", out)
    assert sorted(r for r, _, _ in finals) == ["0", "1", "2"], out[-2000:]
    assert {s for _, s, _ in finals} == {str(STEPS)}
    assert len({d for _, _, d in finals}) == 1, f"replicas disagree: {finals}"

    # Rank 1 was lost once and restarted.
    lost = [
        e for e in ev
        if e["src"] == "agent 0" and e.get("rank") == 1
        and e["event"] in ("worker_exit", "worker_stopped") and e.get("exit_code") != 0
    ]  # fmt: skip
    assert lost, "the fault never happened"
    first_life = lost[0]["incarnation"]
    told = [  # the bus may tell before the process is gone (an uncaught exception)
        e["mono"] for e in ev
        if (e["event"] == "lighthouse_dead" and e["rank"] == 1)
        or (e["event"] == "peer_fault" and e["faulty_rank"] == 1)
    ]  # fmt: skip
    t_fault = min([lost[0]["mono"], *told])

    # The lighthouse dropped it on the bus report, and the survivors' next quorum left the
    # lost life out (no wait for its heartbeat to expire, no Gloo timeout): either without
    # rank 1, or, where its restart was quick enough (a warm spare on a machine with many
    # cores), with its new life healing in that same quorum.
    assert any(e["event"] == "lighthouse_dead" and e["rank"] == 1 for e in ev)
    after = [e for e in ev if e["event"] == "quorum" and e["mono"] >= t_fault]
    healing = {e["quorum"] for e in after if e["src"] == "replica 1" and e["heal"]}
    nxt = {src: next(e for e in after if e["src"] == src) for src in ("replica 0", "replica 2")}
    for src, q in nxt.items():
        assert q["members"] == [0, 2] or q["quorum"] in healing, (src, after)
        assert q["mono"] - t_fault < 5.0, (src, q)  # within torchft's heartbeat timeout
    rollbacks = [e for e in ev if e["event"] == "rollback"]
    listing = "\n".join(
        f"{e['src']} step {e['step']} quorum {e.get('quorum')}: {str(e.get('reason'))[:200]}"
        for e in rollbacks
    )
    assert not any("Timed out" in e.get("reason", "") for e in rollbacks), listing
    # No storm: the broken step, once per survivor, and the join may void one more leased
    # step (a peer asked the lighthouse first: "Quorum leases" in docs/measurements.md).
    # 72 runs here rolled back at most 3; one CI run rolled back 5 within 0.6 s of the
    # fault, the last about when the restarted replica joined (the causes were not kept: the
    # listing now shows them). The bound: two rollbacks for each replica, in all.
    assert len(rollbacks) <= 6, listing

    # Fault-free steps reused their quorum instead of asking the lighthouse (leases); the
    # restarted replica still healed and caught up (above and below).
    ends = [e for e in ev if e["event"] == "replica_end"]
    assert len(ends) == 3 and sum(e["quorums_reused"] for e in ends) > STEPS, ends

    # The survivors kept committing in that quorum.
    ids = {q["quorum"] for q in nxt.values()}
    assert any(e["event"] == "commit" and e["quorum"] in ids for e in ev)

    # The restarted replica (a new life of rank 1) healed from a live peer, then rejoined.
    healed = [
        e for e in ev
        if e["event"] == "quorum" and e["src"] == "replica 1" and e["heal"]
        and e["mono"] > t_fault
    ]  # fmt: skip
    assert healed, "the restarted replica never healed"
    assert healed[0]["max_step"] >= FAULT_STEP
    starts = [e for e in ev if e["event"] == "replica_start" and e["src"] == "replica 1"]
    lives = {parse_replica_id(e["replica_id"]) for e in starts}
    assert len(lives) == 2 and (1, first_life) in lives

    # `fastft report` reads the run like a native one: the one fault, timed from its
    # injection, recovered by the survivors, and the restarted replica committing again.
    report = summarize(run)
    assert [(f["rank"], f["kind"], f["step"]) for f in report["faults"]] == [
        (1, kind, FAULT_STEP)
    ], report["faults"]
    fault = report["faults"][0]
    assert fault["recovered"] and fault["recover_ms"] is not None, fault
    assert fault["rejoin_ms"] is not None, fault
    assert report["last_step"] == STEPS - 1 and report["heals"] >= 1, report

    if kind == "gil_hang":  # a true hang: found by the agent's hang timeout (by its pace),
        # not by Gloo's 60 s, and the survivors, blocked meanwhile, were not taken for hung
        hung = [e for e in ev if e["event"] == "worker_hung"]
        assert [e["rank"] for e in hung] == [1], hung
        assert hung[0]["timeout_s"] < 30, hung

    if kind == "sigstop":  # a stopped peer closes no connection: only the bus tells the
        # survivors (a killed one's sockets close by themselves)
        told = {e["src"] for e in ev if e["event"] == "peer_fault" and e["faulty_rank"] == 1}
        rolled = {e["src"] for e in rollbacks if e["mono"] >= t_fault}
        # a survivor that rolled back was told by the bus (there was no timeout, above);
        # one whose quorum already left rank 1 out had nothing to roll back
        assert rolled <= told, (rolled, told, listing)  # (failed once in a slow tier, session 37)
        # (a survivor still in its forward pass has nothing in flight: its allreduce then
        # fails at once on the poisoned communicator, so `interrupted` may be 0)


SLOW_START = """\
import os, runpy, sys, time
if os.environ.get("FASTFT_RANK") == "1" and os.environ.get("FASTFT_LIFE") == "0":
    time.sleep(float(os.environ["SLOW_START_S"]))  # imports torch this much later
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_replica_that_starts_late_is_in_the_first_quorum(tmp_path: Path) -> None:
    """Regression (16-core GPU machine, `import torch` ~6 s and uneven): under torchft's
    rule with the example's ``min_replica_size=1`` the replicas that were up started
    without the late one, which later trained alone, and its planned fault hit another
    step. The lighthouse's first quorum under ``fastft run`` waits for every replica."""
    wrapper = tmp_path / "slow_start.py"
    wrapper.write_text(SLOW_START)
    run = tmp_path / "late"
    run.mkdir()
    plan = {"faults": [{"kind": "sigkill", "rank": 1, "at_step": 10, "point": "collective"}]}
    (run / "plan.json").write_text(json.dumps(plan))
    cmd = [
        sys.executable, "-m", "fastft.cli", "run", "--torchft", "fastft", "--nproc", "3",
        "--warm-spares", "1", "--job", "late", "--run-dir", str(run),
        "--inject", str(run / "plan.json"), str(wrapper), str(EXAMPLE), "--steps", "40",
    ]  # fmt: skip
    env = {**os.environ, "SLOW_START_S": "4"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    finals = re.findall(r"replica (\d) step (\d+) digest ([0-9a-f]{16})", out)
    assert sorted(r for r, _, _ in finals) == ["0", "1", "2"], out[-2000:]
    assert {s for _, s, _ in finals} == {"40"} and len({d for _, _, d in finals}) == 1, finals
    ev = read_events(run)
    quorums = [e for e in ev if e["event"] == "lighthouse_quorum"]
    assert len(quorums[0]["members"]) == 3, quorums[0]
    faults = summarize(run)["faults"]
    assert [(f["rank"], f["step"]) for f in faults] == [(1, 10)], faults
    assert faults[0]["recovered"], faults


@pytest.mark.slow  # (make test keeps its 10 min bound on a slower 2-core machine)
def test_live_inject_reaches_a_managerfft_replica(tmp_path: Path) -> None:
    """``fastft inject`` on a running ``--torchft fastft`` job: the CLI said "injected" and
    nothing happened (the replicas' bus callback never handed it to their injector)."""
    import time

    run = tmp_path / "live"
    cmd = [
        sys.executable, "-m", "fastft.cli", "run", "--torchft", "fastft", "--nproc", "2",
        "--job", "live", "--run-dir", str(run), str(EXAMPLE), "--steps", "100000",
    ]  # fmt: skip
    with open(tmp_path / "launcher.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while True:
                assert p.poll() is None and time.monotonic() < deadline, "no commit"
                ev = read_events(run) if (run / "events.jsonl").exists() else []
                if any(e["event"] == "commit" and e["src"] == "replica 1" for e in ev):
                    break
                time.sleep(0.1)
            store = next(e["store"] for e in ev if e["event"] == "agent_start")
            inject = [sys.executable, "-m", "fastft.cli", "inject", "--store", store]
            inject += ["--job", "live", "--job-secret-file", str(run / "job.secret")]
            r = subprocess.run(
                [*inject, "--rank", "1", "--kind", "sigkill"], capture_output=True, timeout=60
            )
            assert r.returncode == 0, r.stderr
            while True:
                assert time.monotonic() < deadline + 30, "the injected fault never happened"
                ev = read_events(run)
                if any(e["event"] == "restart" and e["rank"] == 1 for e in ev):
                    break
                time.sleep(0.1)
        finally:
            p.terminate()
            p.wait(60)
    injected = [e for e in ev if e["event"] == "injected" and e["src"] == "replica 1"]
    assert injected and injected[0]["kind"] == "sigkill", injected


IN_USE = "address already in use"
"""What a process of the recipe prints (any case; torch adds EADDRINUSE) when a port the
test drew was taken before it bound it (the OS hands ephemeral ports out again)."""


def _recipe(tmp: Path) -> tuple[list[int], list[str]]:
    """Run the example's torchrun lines once, on ports of the OS's, in ``tmp``: each
    process's exit status (-9: killed, still running when the groups were done) and output."""
    import shlex
    import signal
    import time

    doc = EXAMPLE.read_text().split('"""')[1]
    block = doc[
        doc.index("    fastft secret new") : doc.index("\n\n", doc.index("    fastft secret new"))
    ]
    ports = {p: str(free_port()) for p in ("29600", "29510", "29501", "29502")}
    text = block.replace("\\\n", " ").replace("/tmp/ddp.secret", str(tmp / "ddp.secret"))
    for old, new in ports.items():
        text = text.replace(old, new)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 5, lines  # secret, store, lighthouse, two replica groups
    bin_dir = Path(sys.executable).parent
    base = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    procs: list[subprocess.Popen[str]] = []
    try:
        for line in lines:
            words = shlex.split(line.rstrip("&"))
            env = dict(base)
            while "=" in words[0]:
                k, _, v = words.pop(0).partition("=")
                env[k] = v
            if words[0] == "fastft":
                words = [sys.executable, "-m", "fastft.cli", *words[1:]]
            # (a file, not a pipe: torchft logs every step, and an unread pipe that filled
            # up stopped one group, whose peer's quorum then timed out)
            with open(tmp / f"{len(procs)}.log", "w") as f:
                p = subprocess.Popen(
                    words,
                    cwd=EXAMPLE.parents[1],
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            procs.append(p)
            if "torchrun" in words:
                continue  # (both groups run at once: each waits for the other's quorum)
            if not line.endswith("&"):
                p.wait(timeout=60)
            else:
                time.sleep(1.0)  # (the store and the lighthouse listen before the replicas)
        for p in procs[-2:]:
            try:
                p.wait(timeout=180)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [int(p.returncode) for p in procs]
    return codes, [(tmp / f"{i}.log").read_text() for i in range(len(procs))]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_torchrun_recipe_runs_as_written(tmp_path: Path) -> None:
    """The example's torchrun lines, run as its docstring writes them (ports of the OS's,
    the secret in tmp): both documented recipes failed at start (issue 53: the README's
    without TORCHFT_LIGHTHOUSE, the example's without a job secret). A port the test drew
    that was taken before its process bound it runs the lines once more, on new ports, and
    only that; a failure shows every process's output (CI's one failure showed only the
    replica whose quorum timed out)."""
    for attempt in range(2):
        tmp = tmp_path / f"try{attempt}"
        tmp.mkdir()
        codes, logs = _recipe(tmp)
        if codes[-2:] == [0, 0] or not any(IN_USE in log.lower() for log in logs):
            break
    shown = "\n".join(
        f"--- line {i} exited {c}:\n{log[-2500:]}"
        for i, (c, log) in enumerate(zip(codes, logs, strict=True))
    )
    assert codes[0] == 0 and codes[-2:] == [0, 0], shown
    outs = "".join(logs[-2:])
    digests = set(re.findall(r"replica \d step \d+ digest (\w+)", outs))
    assert len(digests) == 1 and len(re.findall("digest", outs)) == 2, shown
