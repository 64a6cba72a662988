"""The Ray tier's runs (a module of its own: ``conftest`` is not importable by name when
several directories have one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def ray_run(
    cluster,
    run: Path,
    *flags: str,
    steps: int = 40,
    plan: list | None = None,
    wait: bool = True,
    train: tuple[str, ...] = (),
) -> subprocess.Popen | subprocess.CompletedProcess:
    """``fastft ray run`` of the demo on the cluster, 2 nodes x 2 workers."""
    import json

    cmd = [sys.executable, "-m", "fastft.cli", "ray", "run", "--address", cluster.address]
    cmd += ["--nodes", "2", "--nproc", "2", "--run-dir", str(run), "--job", run.name]
    cmd += ["--check-every", "1", "--node-lease-misses", "5", *flags]
    if plan:
        run.mkdir(parents=True, exist_ok=True)
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += ["-m", "fastft.demo.train", "--", "--steps", str(steps), "--out", str(run / "out")]
    cmd += train
    if not wait:  # (the driver's output in RUN.log beside the run: a pipe could fill)
        with open(run.parent / f"{run.name}.log", "w") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)
