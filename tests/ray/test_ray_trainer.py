"""``fastft.ray.Trainer`` (Ray Train's shape) and Ray's own ways of running a job, on the
local two-node cluster: the example driver (``examples/ray_trainer.py``: a training
function, scaling and failure settings) through a worker's SIGKILL, its result (metrics,
run directory, checkpoint); code shipped by ``--working-dir``; the one-machine-per-node
placement refused on a cluster too small for it; ``ray job submit -- fastft ray run``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import check_s1_s3

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
    assert run.parent == tmp_path / "runs" and run.name.startswith("ray-example-")
    assert result["metrics"]["step"] == 16 and isinstance(result["metrics"]["loss"], float)
    assert Path(result["checkpoint"]).name == "step-00000015"  # (the newest that verifies)
    assert result["summary"]["steps_committed"] == 16 and result["summary"]["faults"] == 1
    check_s1_s3(run, 16)
    ev = read_events(run)
    digests = {e["metrics"]["digest"] for e in ev if e["event"] == "train_result"}
    assert len(digests) == 1  # every worker's function ended on the same state
    assert any(e["event"] == "restart" and e["rank"] == 1 for e in ev)


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
