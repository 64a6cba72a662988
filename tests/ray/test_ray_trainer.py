"""``fastft.ray.Trainer`` (Ray Train's shape) and Ray's own ways of running a job, on the
local two-node cluster: the example driver (``examples/ray_trainer.py``: a training
function, scaling and failure settings) through a worker's SIGKILL, its result (metrics,
run directory, checkpoint); code shipped by ``--working-dir``; the one-machine-per-node
placement refused on a cluster too small for it; ``ray job submit -- fastft ray run``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _runs import check_s1_s3

from fastft.report import summarize
from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).parents[2] / "examples" / "ray_trainer.py"


def test_the_trainer_example_survives_a_worker_kill_and_returns_its_result(cluster, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "sigkill", "rank": 1, "at_step": 7}]}))
    cmd = [sys.executable, str(EXAMPLE), "--address", cluster.address, "--steps", "16"]
    cmd += ["--checkpoint-every", "5", "--storage", str(tmp_path / "runs")]
    cmd += ["--flags", f"--inject {plan} --check-every 1"]
    cmd += ["--ray-init"]  # (as every Ray script does: the Trainer failed "no Ray cluster")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    run = Path(result["path"])
    assert run == tmp_path / "runs" / "ray-example"  # (RunConfig(name, storage_path): Ray's)
    assert result["metrics"]["step"] == 16 and isinstance(result["metrics"]["loss"], float)
    # the newest that verifies: step 15's, or step 16's where 15's was skipped behind a
    # running write and deferred to the next commit (a slow machine's disk)
    newest = max((run / "checkpoints").glob("step-*"))
    assert Path(result["checkpoint"]) == newest
    assert newest.name in ("step-00000015", "step-00000016")
    assert result["summary"]["steps_committed"] == 16
    # (the run's own fault list on failure: which events a second fault was made of)
    assert result["summary"]["faults"] == 1, (_faults(run), _said(p.stdout + p.stderr))
    check_s1_s3(run, 16)
    ev = read_events(run)
    digests = {e["metrics"]["digest"] for e in ev if e["event"] == "train_result"}
    assert len(digests) == 1  # every worker's function ended on the same state
    assert any(e["event"] == "restart" and e["rank"] == 1 for e in ev)


def _faults(run: Path) -> list[dict[str, Any]]:
    keep = ("rank", "incarnation", "kind", "cause", "seen_as", "step", "epoch")
    return [{k: f.get(k) for k in keep} for f in summarize(run)["faults"]]


def _said(out: str) -> list[str]:
    """The agents' lines that say why a process died (a worker aborting at its exit)."""
    words = ("terminate", "Abort", "Fatal", "core dumped", "Traceback", "Error")
    return [line for line in out.splitlines() if any(w in line for w in words)][-40:]


def test_code_shipped_with_the_working_dir_runs_on_every_node(cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper.py").write_text("STEPS = 6\n")
    (code / "train.py").write_text(
        "import helper\nfrom fastft.demo.train import main\nmain(['--steps', str(helper.STEPS)])\n"
    )
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastft.cli", "ray", "run", "--address", cluster.address]
    cmd += ["--nodes", "2", "--nproc", "1", "--nats-servers", "0", "--run-dir", str(run)]
    cmd += ["--working-dir", str(code), "--check-every", "1", "train.py"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path.parent)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    check_s1_s3(run, 6)


def test_one_machine_per_node_is_refused_on_a_cluster_too_small_for_it(cluster, tmp_path):
    cmd = [sys.executable, "-m", "fastft.cli", "ray", "run", "--address", cluster.address]
    cmd += ["--nodes", "3", "--nproc", "1", "--cpus-per-node", "1", "--run-dir", str(tmp_path)]
    cmd += ["-m", "fastft.demo.train"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--placement spread" in p.stderr, p.stdout + p.stderr


def test_ray_job_submit_runs_fastft_ray_run(cluster, tmp_path):
    """Ray's own way to run a job: the entrypoint (``fastft ray run ...``) runs on the head
    with ``RAY_ADDRESS`` set, places its node agents, and the job succeeds."""
    dashboard = "http://" + cluster.head_node.address_info["webui_url"]
    run = tmp_path / "job"
    entry = [sys.executable, "-m", "fastft.cli", "ray", "run", "--nodes", "2", "--nproc", "1"]
    entry += ["--nats-servers", "0", "--run-dir", str(run), "--check-every", "1"]
    entry += ["-m", "fastft.demo.train", "--", "--steps", "6"]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    cmd = [ray_cli, "job", "submit", "--address", dashboard, "--", *entry]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "succeeded" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    check_s1_s3(run, 6)


STYLE = Path(__file__).parents[2] / "examples" / "ray_train_style.py"


def style(cluster: Any, storage: Path, *args: str) -> list[str]:
    cmd = [sys.executable, str(STYLE), "--address", cluster.address, "--steps", "12"]
    return [*cmd, "--checkpoint-every", "4", "--storage", str(storage), *args]


def fit(cmd: list[str]) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def clean_digest(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final state of the example's fault-free fit (every rank's, equal)."""
    return str(fit(style(cluster, tmp_path_factory.mktemp("clean")))["metrics"]["digest"])


def test_a_ray_train_script_reports_its_steps_and_checkpoints_through_faults(
    cluster, tmp_path, clean_digest
):
    """examples/ray_train_style.py, written as Ray Train's docs teach (``ray.init()``,
    ``TorchTrainer``, ``ScalingConfig(num_workers=2)``, ``RunConfig(failure_config=...,
    checkpoint_config=CheckpointConfig(num_to_keep=2, score: the lowest loss))``,
    ``train.get_context()``, ``train.report(metrics, checkpoint=...)``), rank 1 SIGKILLed
    at step 7 and an exception on rank 0 at step 9: the result holds every report of rank
    0 (one a commit, in order), the last as its metrics, the two best reported
    checkpoints and no other on disk; every rank ends with the fault-free fit's state."""
    plan = tmp_path / "plan.json"
    faults = [
        {"kind": "sigkill", "rank": 1, "at_step": 7},
        {"kind": "exception", "rank": 0, "at_step": 9},
    ]
    plan.write_text(json.dumps({"faults": faults}))
    result = fit(style(cluster, tmp_path / "runs", "--flags", f"--inject {plan}"))
    history = result["history"]
    assert [h["step"] for h in history] == [*range(1, 13), 12], history
    assert all(h["world"] == 2 for h in history)
    assert result["metrics"] == history[-1] and "digest" in result["metrics"]
    best = result["best"]
    losses = {h["step"]: h["loss"] for h in history[:-1]}
    want = sorted((4, 8, 12), key=lambda s: losses[s])[:2]
    assert [m["step"] for _, m in best] == want, (best, losses)
    kept = sorted(p.name for p in (Path(result["path"]) / "reported").iterdir())
    assert len(kept) == 2 and {Path(c).name for c, _ in best} == set(kept), kept
    assert all((Path(c) / "model.pt").exists() for c, _ in best)
    assert result["checkpoint"] in {c for c, _ in best}  # (the newer of the two kept)
    ev = read_events(Path(result["path"]))
    digests = {e["metrics"].get("digest") for e in ev if e["event"] == "train_report"} - {None}
    assert digests == {clean_digest}, digests  # every rank's, the fault-free fit's
    assert any(e["event"] == "restart" and e["rank"] == 1 for e in ev)
    assert any(e["event"] == "rollback" for e in ev)


def test_a_preempted_ray_train_run_resumes_from_its_reported_checkpoint(
    cluster, tmp_path, clean_digest
):
    """SIGTERM to the driver once rank 0 reported the checkpoint of step 4: the job
    drains and the fit fails (TrainingFailed); the same command (the same
    ``RunConfig(name, storage_path)``) goes on in the same run directory, its function's
    ``train.get_checkpoint()`` the newest reported one, loaded and named to
    ``ft.register(step=...)``: the fit ends with the fault-free fit's state."""
    storage = tmp_path / "runs"
    cmd = style(cluster, storage, "--step-time", "0.2")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        reported = storage / "ray-train-style" / "reported"
        deadline = time.monotonic() + 180
        while not (
            reported.is_dir() and any(not d.name.startswith(".") for d in reported.iterdir())
        ):
            assert p.poll() is None and time.monotonic() < deadline, (
                p.stdout.read() if p.stdout else ""
            )
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    failed = json.loads(out.strip().splitlines()[-1])
    assert p.returncode == 1 and "failed" in failed, out[-3000:]  # (TrainingFailed)
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "fastft ray: resuming the run in" in resumed.stdout, resumed.stdout[-3000:]
    result = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert result["metrics"]["digest"] == clean_digest, result["metrics"]
    ev = read_events(Path(result["path"]))
    firsts = [e for e in ev if e["event"] == "epoch" and e.get("step", 0) >= 4]
    assert firsts, "the resumed run began at a reported step, not at 0"


def test_a_ray_train_function_that_raises_fails_the_fit_naming_its_error(cluster, tmp_path):
    """A ValueError of the script's own on rank 1 at step 3 (the same again in the step's
    retry): ``fit()`` raises ``TrainingFailed`` naming it, without the restarts a worker's
    death gets (it took 29 s, and said only "status 1": issue 62)."""
    cmd = [sys.executable, str(STYLE), "--address", cluster.address, "--steps", "12"]
    cmd += ["--fail-at", "3", "--storage", str(tmp_path / "runs")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    failed = json.loads(p.stdout.strip().splitlines()[-1])
    assert "raised ValueError at" in failed["failed"], failed
    assert "a bad batch at step 3" in failed["failed"], failed
    ev = read_events(Path(failed["path"]))
    (raised,) = [e["t"] for e in ev if e["event"] == "local_fault"][:1]
    print(f"fit() failed {failed['wall'] - raised:.2f} s after the first raise")
    assert not [e for e in ev if e["event"] == "restart"], "a restart cannot help"


def test_a_ray_train_script_runs_under_ray_job_submit(cluster, tmp_path):
    """The Ray Train script as Ray's own job: ``ray job submit -- python
    examples/ray_train_style.py`` (its ``ray.init()`` finds the cluster through the job's
    ``RAY_ADDRESS``); the job succeeds with every report."""
    dashboard = "http://" + cluster.head_node.address_info["webui_url"]
    entry = [sys.executable, str(STYLE), "--steps", "6", "--checkpoint-every", "3"]
    entry += ["--storage", str(tmp_path / "runs")]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    cmd = [ray_cli, "job", "submit", "--address", dashboard, "--", *entry]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "succeeded" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in reversed(p.stdout.splitlines()) if x.startswith('{"metrics"'))
    result = json.loads(line)
    assert [h["step"] for h in result["history"]] == [*range(1, 7), 6], result["history"]
    check_s1_s3(Path(result["path"]), 6)
