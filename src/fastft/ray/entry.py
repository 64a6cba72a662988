"""A worker of a :class:`fastft.ray.Trainer` job: loads the pickled training function and
its config (written on this node by its agent actor), calls it, and records what it
returned (a dict: the result's metrics) in the run's event log as ``train_result``.

    python -m fastft.ray.entry PICKLE        # (fastft run -m fastft.ray.entry -- PICKLE)
"""

from __future__ import annotations

import inspect
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from fastft.process.events import EventLog
from fastft.ray.trainer import RESULT_EVENT


def call(fn: Any, config: Any) -> Any:
    """``fn(config)``, or ``fn()`` for a function of no argument given no config."""
    try:
        takes = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes = 1
    return fn() if takes == 0 and config is None else fn(config)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--"]
    if len(args) != 1:
        sys.exit("usage: python -m fastft.ray.entry PICKLE (written by fastft.ray.Trainer)")
    fn, config, *more = pickle.loads(Path(args[0]).read_bytes())  # noqa: S301 (the job's own)
    options = more[0] if more else {}
    if options.get("keep"):  # (CheckpointConfig.num_to_keep: train.report prunes)
        os.environ["FASTFT_REPORTED_KEEP"] = str(options["keep"])
    got = call(fn, config)
    if isinstance(got, dict):
        rank = int(os.environ.get("FASTFT_RANK", "-1"))
        log = EventLog(os.environ.get("FASTFT_RUN_DIR"), f"rank {rank}")
        log.emit(RESULT_EVENT, rank=rank, metrics=got)
        log.close()


if __name__ == "__main__":
    main()
