"""The demo's live display: each worker's phase, step, epoch and life, and the faults as
they happen, read from the run's event log while the job runs (rich)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

__all__ = ["LiveState"]

_COLORS = {
    "NORMAL": "green",
    "HEALING": "cyan",
    "INIT": "blue",
    "EXIT": "dim",
    "DEAD": "red",
    "STOPPED": "red",
}


@dataclass
class _Worker:
    phase: str = "INIT"
    step: int = 0
    epoch: int = 0
    life: int = 0
    last: str = ""
    starting: str = ""
    """While it starts (phase INIT): what it is doing, shown with the time since ``since``."""
    since: float = 0.0


@dataclass
class LiveState:
    """Folds ``events.jsonl`` into a per-worker view; :meth:`poll` reads what was
    appended since the last call."""

    run_dir: Path
    title: str = ""
    workers: dict[int, _Worker] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    _offset: int = 0
    _t0: float | None = None

    def poll(self) -> None:
        path = self.run_dir / "events.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._offset += end
        for line in data[:end].splitlines():
            try:
                self._fold(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue

    def _fold(self, e: dict[str, Any]) -> None:
        if self._t0 is None:
            self._t0 = e["mono"]
        t = e["mono"] - self._t0
        name, src = e["event"], e["src"]
        if src.startswith("agent"):
            r = e.get("rank")
            if r is None:
                return
            w = self.workers.setdefault(r, _Worker())
            if name == "spawn":
                w.life, w.phase, w.last = e["life"], "INIT", "started"
                w.starting = "starting Python, importing torch and the script"
                w.since = e["mono"]
            elif name == "worker_exit" and e.get("exit_code") != 0:
                w.phase = "DEAD"
                how = f"signal {e['signal']}" if e.get("signal") else f"code {e['exit_code']}"
                w.last = f"exited ({how})"
                self.faults.append(f"{t:7.2f}s  rank {r} exited ({how}); restarting")
            elif name == "worker_stopped":
                w.phase, w.last = "STOPPED", "SIGSTOPped"
                self.faults.append(f"{t:7.2f}s  rank {r} stopped (hang); killing it")
            elif name == "worker_hung":
                w.phase, w.last = "STOPPED", "hung"
                self.faults.append(f"{t:7.2f}s  rank {r} silent {e['silent_s']} s; killing it")
            elif name == "worker_exit":
                w.phase, w.last = "EXIT", "finished"
            return
        r = int(src.split()[1])
        w = self.workers.setdefault(r, _Worker())
        if name == "worker_start" and w.phase == "INIT":
            w.starting = "fastft.init(): building the model, joining the first epoch"
        elif name in ("epoch", "commit", "phase", "heal"):
            w.starting = ""
        if name == "phase":
            w.phase, w.epoch = e["to"], e["epoch"]
        elif name == "rollback" and e.get("reason"):
            w.last = f"rollback: {e['reason'][:48]}"
        elif name == "commit":
            w.step, w.epoch = e["step"] + 1, e["epoch"]
            if w.phase not in ("NORMAL", "EXIT"):
                w.phase = "NORMAL"
        elif name == "epoch":
            w.epoch, w.last = e["epoch"], f"epoch {e['epoch']}: members {e['members']}"
        elif name == "heal" and e.get("role") == "fetch":
            w.last = f"healed at step {e['step']} ({e['bytes']} B, {e['heal_ms']:.0f} ms)"
        elif name == "injected":
            self.faults.append(f"{t:7.2f}s  injected {e['kind']} into rank {r} at step {e['step']}")
        elif name == "worker_stop":
            w.phase = "EXIT"

    def render(self) -> Group:
        table = Table(title=self.title, expand=False)
        for col in ("rank", "phase", "step", "epoch", "life", "last event"):
            table.add_column(col)
        now = time.monotonic()
        for r in sorted(self.workers):
            w = self.workers[r]
            color = _COLORS.get(w.phase, "white")
            last = f"{w.starting} ({now - w.since:.1f} s)" if w.starting else w.last
            table.add_row(
                str(r),
                Text(w.phase, style=color),
                str(w.step),
                str(w.epoch),
                str(w.life),
                last,
            )
        lines = [Text(f) for f in self.faults[-8:]]
        return Group(table, *lines)


def follow(run_dir: Path, title: str, proc: Any, refresh_s: float = 0.25) -> int:
    """Show the live view of ``run_dir`` until ``proc`` (a Popen) ends; its exit code."""
    from rich.live import Live

    state = LiveState(run_dir, title)
    with Live(state.render(), refresh_per_second=8, transient=False) as live:
        while proc.poll() is None:
            state.poll()
            live.update(state.render())
            time.sleep(refresh_s)
        state.poll()
        live.update(state.render())
    return int(proc.returncode)
