"""A Ray-native entry in the shape Ray Train users know: a trainer object that runs a
training function (or a script) on the cluster with scaling and failure settings, and
returns a result with the final metrics, the run directory and the checkpoint::

    from fastft.ray import Trainer, ScalingConfig, RunConfig

    def train_loop(config):                   # runs in every worker, under fastft
        ft = fastft.init()
        ...
        ft.close()
        return {"loss": last_loss}            # rank 0's is the result's metrics

    result = Trainer(
        train_loop,
        train_loop_config={"lr": 3e-4},
        scaling_config=ScalingConfig(num_nodes=2, workers_per_node=4),
        run_config=RunConfig(name="lm", checkpoint_every=100),
    ).fit()
    print(result.metrics, result.path, result.checkpoint)

It is :func:`fastft.ray.run` underneath (node agents as actors, ``fastft run`` on each):
the function is pickled (``ray.cloudpickle``), shipped to every node with the job, and run
by :mod:`fastft.ray.entry` in each worker. Unlike Ray Train, a worker's fault is not a
restart of the whole group from a checkpoint: the peers roll back the step, the worker is
restarted alone and healed from a live peer (``FailureConfig.max_worker_restarts``), and a
lost node is taken over by its warm standby agent (``FailureConfig.max_node_restarts``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastft.errors import RayJobError
from fastft.process.events import EVENTS_FILE

__all__ = ["FailureConfig", "Result", "RunConfig", "ScalingConfig", "Trainer", "TrainingFailed"]

RESULT_EVENT = "train_result"
"""The event a worker's training function records its return value in."""


@dataclass(frozen=True)
class ScalingConfig:
    """How many node agents and workers, and what each node's bundle holds."""

    num_nodes: int = 1
    workers_per_node: int = 1
    cpus_per_node: float | None = None
    """Each bundle's CPUs (default: the workers plus one for the agent)."""
    gpus_per_node: float = 0.0
    placement: str = "strict"
    """``strict``: each node on a machine of its own; ``spread``: machines may be shared."""


@dataclass(frozen=True)
class FailureConfig:
    max_node_restarts: int = 3
    """How many times a node's agent actor may be replaced (by its standby or a new one)."""
    standby_agents: bool = True
    """A warm standby agent per node (``fastft ray run --no-standby-agents``: none)."""
    max_worker_restarts: int | None = None
    """``fastft run --max-restarts``: restarts of one worker (None: fastft's default)."""


@dataclass(frozen=True)
class RunConfig:
    name: str | None = None
    """The job's name (default: ``ray-XXXXXX``)."""
    storage_path: str | None = None
    """Where run directories go (default ``./runs``): ``STORAGE/NAME-TIME-PID``."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: none)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (default ``RUN_DIR/checkpoints``; shared storage across
    machines)."""
    runtime_env: dict[str, Any] | None = None
    """Ray's, for the node agents and their workers (``working_dir``, ``pip``, ...)."""
    flags: Sequence[str] = ()
    """Any other ``fastft run`` flags (``--min-replicas 2``, ``--warm-spares 1``, ...)."""


@dataclass(frozen=True)
class Result:
    metrics: dict[str, Any]
    """What the training function returned on the lowest rank that returned a dict (a
    script: ``{}``)."""
    path: Path
    """The run directory: ``fastft report PATH`` reads it."""
    checkpoint: Path | None
    """The newest checkpoint that verifies (None: none written)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """``fastft report``'s figures: steps committed, faults, goodput."""


class TrainingFailed(RayJobError):
    """The job ended with a non-zero status; ``result`` holds what it left."""

    def __init__(self, status: int, result: Result, why: str = "") -> None:
        super().__init__(
            f"the job failed (status {status}){': ' + why if why else ''}; its run "
            f"directory: {result.path} (fastft report {result.path})"
        )
        self.status = status
        self.result = result
        self.why = why
        """What the run's events say failed it (the job's reason, the last worker error)."""


class Trainer:
    """Runs ``train_loop_per_worker`` (a function of ``train_loop_config``, or of nothing)
    or a script (``"train.py"``, ``["train.py", "--lr", "3e-4"]``, ``["-m", "pkg.train"]``)
    on the Ray cluster at ``address`` (None: ``RAY_ADDRESS`` or the running one)."""

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any] | str | Sequence[str],
        *,
        train_loop_config: dict[str, Any] | None = None,
        scaling_config: ScalingConfig | None = None,
        failure_config: FailureConfig | None = None,
        run_config: RunConfig | None = None,
        address: str | None = None,
    ) -> None:
        self.loop = train_loop_per_worker
        self.config = train_loop_config
        self.scaling = scaling_config or ScalingConfig()
        self.failure = failure_config or FailureConfig()
        self.run_config = run_config or RunConfig()
        self.address = address
        if not callable(self.loop) and self.config is not None:
            raise ValueError(
                "train_loop_config: only for a training function (a script reads its arguments)"
            )

    def _checkpoint_dir(self, run_dir: Path) -> Path:
        rc = self.run_config
        return Path(rc.checkpoint_dir).resolve() if rc.checkpoint_dir else run_dir / "checkpoints"

    def fastft_flags(self, run_dir: Path) -> list[str]:
        """The ``fastft run`` flags of the job: the run config's own, its checkpoints, the
        failure config's worker restarts, and (a training function in a driver that
        imported JAX) the zygote's preload of JAX, which it cannot read from a pickle."""
        rc = self.run_config
        flags = list(rc.flags)
        if rc.checkpoint_every:
            flags += ["--checkpoint-dir", str(self._checkpoint_dir(run_dir))]
            flags += ["--checkpoint-every", str(rc.checkpoint_every)]
        if self.failure.max_worker_restarts is not None:
            flags += ["--max-restarts", str(self.failure.max_worker_restarts)]
        given = {f.partition("=")[0] for f in flags}
        if (
            callable(self.loop)
            and "jax" in sys.modules
            and not given & {"--preload", "--start-method"}
        ):
            flags += ["--preload", "jax,fastft.jax"]
        return flags

    def fit(self) -> Result:
        """Run the job to its end; its :class:`Result`, or :class:`TrainingFailed`."""
        from fastft.process.rundir import default_run_dir
        from fastft.ray.driver import run

        rc = self.run_config
        name = rc.name or "ray"
        if rc.storage_path is not None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = Path(rc.storage_path, f"{name}-{stamp}-{os.getpid()}")
        else:
            run_dir = default_run_dir(name)
        run_dir = run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        flags = self.fastft_flags(run_dir)
        ckpt = self._checkpoint_dir(run_dir)
        files: dict[str, bytes] = {}
        if callable(self.loop):
            from ray import cloudpickle

            fn_path = str(run_dir / "train_loop.pkl")
            files[fn_path] = cloudpickle.dumps((self.loop, self.config))
            script = ["-m", "fastft.ray.entry", "--", fn_path]
        elif isinstance(self.loop, str):
            script = [self.loop]
        else:
            script = list(self.loop)
        status = run(
            [*flags, *script],
            nodes=self.scaling.num_nodes,
            nproc=self.scaling.workers_per_node,
            address=self.address,
            run_dir=str(run_dir),
            job=rc.name,
            cpus_per_node=self.scaling.cpus_per_node,
            gpus_per_node=self.scaling.gpus_per_node,
            max_node_restarts=self.failure.max_node_restarts,
            standby=self.failure.standby_agents,
            placement=self.scaling.placement,
            runtime_env=rc.runtime_env,
            files=files,
            out=sys.stdout,
        )
        result = Result(
            metrics=_metrics(run_dir),
            path=run_dir,
            checkpoint=_newest_checkpoint(ckpt),
            summary=_summary(run_dir),
        )
        if status != 0:
            raise TrainingFailed(status, result, _why_failed(_events(run_dir)))
        return result


def _why_failed(ev: list[dict[str, Any]]) -> str:
    """The job's failure as its events tell it: the agent's reason, and the last error a
    worker raised (a training function's ``ValueError`` said only "status 1")."""
    reason = next((str(e.get("reason", "")) for e in ev if e["event"] == "job_failed"), "")
    errors = [
        f"{e['src']}: {e.get('error') or e.get('cause')}"
        for e in ev
        if e["event"] in ("script_error", "local_fault") and (e.get("error") or e.get("cause"))
    ]
    parts = [p for p in (reason, errors[-1] if errors else "") if p]
    return "; ".join(parts)[:600]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events: the driver's machine's file and those copied from other nodes."""
    out = []
    for f in [run_dir / EVENTS_FILE, *sorted(run_dir.glob(f"node*/{EVENTS_FILE}"))]:
        if f.exists():
            for line in f.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def _metrics(run_dir: Path) -> dict[str, Any]:
    got = [e for e in _events(run_dir) if e.get("event") == RESULT_EVENT]
    if not got:
        return {}
    return dict(min(got, key=lambda e: (e.get("rank", 1 << 30), -e.get("mono", 0)))["metrics"])


def _newest_checkpoint(root: Path) -> Path | None:
    from fastft.runtime.durable.checkpoints import CheckpointError, verify

    steps = sorted(root.glob("step-*"), key=lambda p: -int(p.name.partition("-")[2] or -1))
    for p in steps:
        try:
            verify(p)
        except (CheckpointError, OSError, ValueError):
            continue
        return p
    return None


def _summary(run_dir: Path) -> dict[str, Any]:
    from fastft.report import summarize

    try:
        s = summarize(run_dir)
    except Exception:  # (a run that ended before it wrote an event)
        return {}
    keys = ("steps_committed", "last_step", "goodput", "median_step_ms", "outcome")
    return {k: s[k] for k in keys if k in s} | {"faults": len(s.get("faults", []))}
