"""Ray Train's calls inside a training function, for ``fastft.ray.Trainer`` (``from
fastft.ray import train`` where a Ray Train script has ``from ray import train``)::

    def train_loop(config):
        ctx = train.get_context()              # world size, rank, local rank, node rank
        ft = fastft.init()
        ...
        while ft.step < config["steps"]:
            with ft.transaction() as tx:
                ...
            if tx.committed:
                with tempfile.TemporaryDirectory() as d:
                    torch.save(model.state_dict(), f"{d}/model.pt")
                    train.report({"loss": loss, "step": ft.step},
                                 checkpoint=train.Checkpoint.from_directory(d))

:func:`report` records the metrics of every call as a ``train_report`` event (the result's
``metrics_history``; the lowest rank's last are its ``metrics``); a checkpoint reported by
the lowest rank is copied into the run directory (``RUN_DIR/reported/LIFE-NNNNNN``, whole or
not at all), the newest ``CheckpointConfig.num_to_keep`` kept. Unlike Ray Train's, a
report is no barrier: a worker's fault costs a rollback and a heal, not a restart of the
group from the last reported checkpoint, so nothing waits for the others to report."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastft.process.events import EventLog

__all__ = [
    "REPORT_EVENT",
    "Checkpoint",
    "TrainContext",
    "get_checkpoint",
    "get_context",
    "report",
]

REPORT_EVENT = "train_report"
"""The event each :func:`report` records (rank, index, metrics, the checkpoint's path)."""
REPORTED = "reported"
"""The run directory's folder of reported checkpoints."""


@dataclass(frozen=True)
class Checkpoint:
    """A directory of files (Ray Train's ``Checkpoint``): what a training function reports,
    and what a result holds."""

    path: Path

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        p = Path(path)
        if not p.is_dir():
            raise ValueError(f"Checkpoint.from_directory({str(path)!r}): no such directory")
        return cls(p.resolve())

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """The checkpoint's directory, to read (it is local: nothing is downloaded)."""
        yield str(self.path)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """A copy of the checkpoint's files in ``path`` (a new temporary directory: None)."""
        dest = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="ckpt-"))
        shutil.copytree(self.path, dest, dirs_exist_ok=True)
        return str(dest)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class TrainContext:
    """Where this worker is (Ray Train's ``train.get_context()``): the job's slots, not a
    current epoch's members (an elastic epoch may hold fewer: ``ft.world``)."""

    world_size: int
    world_rank: int
    local_rank: int
    local_world_size: int
    experiment_name: str
    storage_path: str | None

    def get_world_size(self) -> int:
        return self.world_size

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.world_rank // max(self.local_world_size, 1)

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_trial_name(self) -> str:
        return self.experiment_name

    def get_storage_path(self) -> str | None:
        """The run directory (where the job's events and reported checkpoints go)."""
        return self.storage_path


def get_context() -> TrainContext:
    """This worker's :class:`TrainContext`, from the environment ``fastft run`` gives it;
    RuntimeError outside a job."""
    env = os.environ
    if "FASTFT_RANK" not in env or "FASTFT_WORLD_SIZE" not in env:
        raise RuntimeError(
            "train.get_context(): not in a fastft job (run the function through "
            "fastft.ray.Trainer, or the script under fastft run)"
        )
    return TrainContext(
        world_size=int(env["FASTFT_WORLD_SIZE"]),
        world_rank=int(env["FASTFT_RANK"]),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        experiment_name=env.get("FASTFT_JOB", ""),
        storage_path=env.get("FASTFT_RUN_DIR"),
    )


def get_checkpoint() -> Checkpoint | None:
    """The newest checkpoint a previous run of this run reported (Ray Train's resume: a
    fit again with the same ``RunConfig(name=..., storage_path=...)``), for a worker that
    starts the job; None at a first start, and in a restarted worker, which takes the live
    state from a peer when it registers (``ft.register``). A script that loads it tells
    fastft its step (``ft.register(..., step=saved_step)``); the durable tier's newer
    checkpoint, if any, wins (``RunConfig.checkpoint_every``)."""
    env = os.environ
    if int(env.get("FASTFT_LIFE", "0") or 0) > 0 or not env.get("FASTFT_RUN_DIR"):
        return None
    started = float(env.get("FASTFT_JOB_STARTED") or "inf")
    newest = newest_reported(Path(env["FASTFT_RUN_DIR"]), before=started)
    return Checkpoint(newest) if newest is not None else None


def newest_reported(run_dir: Path, before: float = float("inf")) -> Path | None:
    """The newest whole checkpoint in ``RUN_DIR/reported`` written before ``before``
    (wall clock), or None."""
    root = run_dir / REPORTED
    if not root.is_dir():
        return None
    done = [
        (p.stat().st_mtime, p)
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and p.stat().st_mtime < before
    ]
    return max(done)[1] if done else None


_COUNT = itertools.count()
"""This process's reports, numbered."""


def report(metrics: dict[str, Any], *, checkpoint: Checkpoint | None = None) -> None:
    """Record ``metrics`` (a dict of JSON values) as this worker's ``index``-th report; on
    the lowest rank, copy ``checkpoint``'s files into the run directory. Call it after a
    commit (``if tx.committed:``): a rolled-back step reports nothing."""
    if not isinstance(metrics, dict):
        raise TypeError(f"train.report(metrics): a dict, not {type(metrics).__name__}")
    ctx = get_context()
    run_dir, index = ctx.storage_path, next(_COUNT)
    saved: str | None = None
    if checkpoint is not None and ctx.world_rank == 0 and run_dir is not None:
        saved = str(_keep(Path(run_dir) / REPORTED, index, checkpoint))
    log = EventLog(run_dir, f"rank {ctx.world_rank}")
    try:
        log.emit(
            REPORT_EVENT,
            rank=ctx.world_rank,
            index=index,
            metrics=metrics,
            **({"checkpoint": saved} if saved else {}),
        )
    finally:
        log.close()


def _keep(root: Path, index: int, checkpoint: Checkpoint) -> Path:
    """Copy ``checkpoint`` to ``root/INDEX`` (a temporary name, then a rename: whole or
    not at all); drop the oldest past ``FASTFT_REPORTED_KEEP`` (``CheckpointConfig``'s
    ``num_to_keep``, set by the trainer's entry)."""
    root.mkdir(parents=True, exist_ok=True)
    life = int(os.environ.get("FASTFT_LIFE", "0") or 0)  # (a restarted rank counts anew)
    name = f"{life:03d}-{index:06d}"
    dest, tmp = root / name, root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint.path, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    keep = int(os.environ.get("FASTFT_REPORTED_KEEP", "0") or 0)
    if keep > 0:
        done = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        for old in sorted(done, key=lambda p: p.stat().st_mtime)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return dest
