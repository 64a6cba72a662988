"""Shared helpers: percentiles, the JSON result file and the printed table."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summary_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms)}


def write(name: str, rows: list[dict[str, object]], meta: dict[str, object]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        **meta,
        "rows": rows,
    }
    path.write_text(json.dumps(doc, indent=2))
    return path


def table(rows: list[dict[str, object]], cols: list[str]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    line = "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(fmt(r[c]).ljust(w) for c, w in zip(cols, widths, strict=True)) + " |"
        for r in rows
    ]
    return "\n".join([line, sep, *body])


class Progress:
    """Where a long benchmark is: ``[3/12 2m41s, ~6m left] sigkill world 3 trial 1``. A
    rich bar on a terminal (the rows a benchmark prints scroll above it); one line per
    item on stderr otherwise (CI logs, ``| tee``)."""

    def __init__(self, name: str, total: int) -> None:
        import sys

        self.name, self.total, self.done = name, max(total, 1), 0
        self.t0 = time.monotonic()
        self._bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn(f"{name} [bold]{{task.description}}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total)

    def next(self, label: str) -> None:
        """Item ``label`` starts (the one before it is done)."""
        import sys

        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=label)
        else:
            spent = time.monotonic() - self.t0
            left = (
                f", ~{_dur(spent / self.done * (self.total - self.done))} left" if self.done else ""
            )
            print(f"[{self.name} {self.done + 1}/{self.total} {_dur(spent)}{left}] {label}",
                  file=sys.stderr, flush=True)  # fmt: skip
        self.done += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.total)
            self._bar.stop()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dur(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"
