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

Ray Train's spellings work too (:mod:`fastft.ray.configs`, :mod:`fastft.ray.train`):
``TorchTrainer``, ``ScalingConfig(num_workers=4)``, ``RunConfig(failure_config=
FailureConfig(max_failures=3), checkpoint_config=CheckpointConfig(num_to_keep=2))``, and in
the function ``train.get_context()`` and ``train.report(metrics, checkpoint=...)``; the
result then holds every report (``metrics_history``), the last (``metrics``) and the kept
checkpoints (``checkpoint``, ``best_checkpoints``).

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
from fastft.ray.configs import (
    CheckpointConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    coerce,
)
from fastft.ray.train import REPORT_EVENT, Checkpoint, newest_reported

__all__ = [
    "CheckpointConfig",
    "FailureConfig",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TorchTrainer",
    "Trainer",
    "TrainingFailed",
]

RESULT_EVENT = "train_result"
"""The event a worker's training function records its return value in."""


@dataclass(frozen=True)
class Result:
    metrics: dict[str, Any]
    """What the training function returned on the lowest rank that returned a dict, else
    the lowest rank's last ``train.report`` (a script that does neither: ``{}``)."""
    path: Path
    """The run directory: ``fastft report PATH`` reads it."""
    checkpoint: Checkpoint | None
    """The newest kept reported checkpoint, else fastft's newest durable checkpoint that
    verifies (None: none)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """``fastft report``'s figures: steps committed, faults, goodput."""
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    """The lowest rank's ``train.report`` metrics, in order (Ray's ``metrics_dataframe``
    rows)."""
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    """The kept reported checkpoints and their metrics, best first
    (``CheckpointConfig``'s score; the newest first without one)."""
    error: str | None = None
    """Why the job failed (:class:`TrainingFailed` carries it), None if it did not."""


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
        scaling_config: Any = None,
        failure_config: Any = None,
        run_config: Any = None,
        address: str | None = None,
        datasets: dict[str, Any] | None = None,
    ) -> None:
        self.loop = train_loop_per_worker
        self.config = train_loop_config
        self.scaling = coerce(scaling_config, ScalingConfig) or ScalingConfig()
        self.run_config = coerce(run_config, RunConfig) or RunConfig()
        self.failure = (
            coerce(failure_config, FailureConfig)
            or self.run_config.failure_config
            or FailureConfig()
        )
        self.keep = self.run_config.checkpoint_config or CheckpointConfig()
        self.address = address
        if not callable(self.loop) and self.config is not None:
            raise ValueError(
                "train_loop_config: only for a training function (a script reads its arguments)"
            )
        if datasets:
            raise ValueError(
                "datasets=: Ray Data shards are not built in fastft.ray; read the data in "
                "the training function, through fastft.Batches(loader), whose position "
                "every rollback, heal and checkpoint carries"
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
            if self.keep.num_to_keep is not None:
                flags += ["--checkpoint-keep", str(self.keep.num_to_keep)]
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
        if rc.storage_path is not None and rc.name:
            run_dir = Path(rc.storage_path, rc.name)  # (Ray Train's: the same run again)
        elif rc.storage_path is not None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = Path(rc.storage_path, f"{name}-{stamp}-{os.getpid()}")
        else:
            run_dir = default_run_dir(name)
        run_dir = run_dir.resolve()
        if (previous := newest_reported(run_dir)) is not None:
            print(
                f"fastft ray: resuming the run in {run_dir}: its functions' "
                f"train.get_checkpoint() gives {previous.name}",
                file=sys.stdout,
                flush=True,
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        flags = self.fastft_flags(run_dir)
        ckpt = self._checkpoint_dir(run_dir)
        files: dict[str, bytes] = {}
        if callable(self.loop):
            from ray import cloudpickle

            fn_path = str(run_dir / "train_loop.pkl")
            # (a keep by recency prunes as the reports come; by score, at the end)
            recent = None if self.keep.checkpoint_score_attribute else self.keep.num_to_keep
            files[fn_path] = cloudpickle.dumps((self.loop, self.config, {"keep": recent}))
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
        ev = _events(run_dir)
        history = _history(ev)
        best = _kept(ev, self.keep)
        newest = max(best, key=lambda b: b[1].get("_t", 0.0))[0] if best else None
        durable = _newest_checkpoint(ckpt)
        why = _why_failed(ev) if status != 0 else None
        result = Result(
            metrics=_metrics(ev) or (history[-1] if history else {}),
            path=run_dir,
            checkpoint=newest or (Checkpoint(durable) if durable is not None else None),
            summary=_summary(run_dir),
            metrics_history=history,
            best_checkpoints=[(c, {k: v for k, v in m.items() if k != "_t"}) for c, m in best],
            error=why,
        )
        if status != 0:
            raise TrainingFailed(status, result, why or "")
        return result


TorchTrainer = Trainer
"""Ray Train's name for it (``ray.train.torch.TorchTrainer``)."""


def _why_failed(ev: list[dict[str, Any]]) -> str:
    """The job's failure as its events tell it: the agent's reason, and the last error a
    worker raised (a training function's ``ValueError`` said only "status 1")."""
    reason = next((str(e.get("reason", "")) for e in ev if e["event"] == "job_failed"), "")
    errors = [
        f"{e['src']}: {e.get('error') or e.get('cause')}"
        for e in ev
        if e["event"] in ("script_error", "local_fault") and (e.get("error") or e.get("cause"))
    ]
    parts = [p for p in (errors[-1] if errors else "", reason) if p]  # (the specific first)
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


def _metrics(ev: list[dict[str, Any]]) -> dict[str, Any]:
    got = [e for e in ev if e.get("event") == RESULT_EVENT]
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


def _reports(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lowest reporting rank's ``train.report`` events, in the order it reported."""
    got = [e for e in ev if e.get("event") == REPORT_EVENT]
    if not got:
        return []
    low = min(e.get("rank", 1 << 30) for e in got)
    return sorted((e for e in got if e.get("rank") == low), key=lambda e: e.get("t", 0.0))


def _history(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(e["metrics"]) for e in _reports(ev)]


def _kept(ev: list[dict[str, Any]], cfg: CheckpointConfig) -> list[tuple[Checkpoint, dict]]:
    """The reported checkpoints still on disk, best first, the rest past
    ``cfg.num_to_keep`` removed (by ``cfg``'s score, or the newest)."""
    import shutil

    got = [
        (Checkpoint(Path(e["checkpoint"])), {**e["metrics"], "_t": e.get("t", 0.0)})
        for e in ev
        if e.get("event") == REPORT_EVENT and e.get("checkpoint")
    ]
    got = [(c, m) for c, m in got if c.path.is_dir()]
    attr = cfg.checkpoint_score_attribute
    if attr is not None:
        scored = [(c, m) for c, m in got if isinstance(m.get(attr), int | float)]
        got = sorted(scored, key=lambda b: b[1][attr], reverse=cfg.checkpoint_score_order == "max")
    else:
        got.sort(key=lambda b: b[1]["_t"], reverse=True)
    if cfg.num_to_keep is not None:
        for c, _ in got[cfg.num_to_keep :]:
            shutil.rmtree(c.path, ignore_errors=True)
        got = got[: cfg.num_to_keep]
    return got
