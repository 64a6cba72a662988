"""Shared helpers: percentiles, the JSON result file and the printed table."""

from __future__ import annotations

import json
import os
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


QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}
"""For a harness's processes that open hundreds of store connections: torch's TCPStore
client formats each address it connects to with ``getnameinfo``, a reverse DNS query
for a loopback address (reached as ``::ffff:127.0.0.1`` or ``::1``, in no hosts file
here). This machine's resolver drops one query in 50 when they come in a burst, and that
connection then waits the resolver's timeout, 5 s: 64 members' connections took ~80 s,
512 members' would take ~10 minutes. With one attempt of 1 s (glibc's ``RES_OPTIONS``)
such a connection waits 1 s. Only set up is concerned: no connection is opened within
the measured window. (A job's workers open a few connections each, spread out: none of
a 60 s chaos soak's 23 restarts took more than 0.2 s to start.)"""


_STORE_HOST = r"""
import datetime, sys
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=300))
print(s.port, flush=True)
sys.stdin.read()
"""


class StoreHost:
    """A TCPStore hosted by a process of its own (``with StoreHost() as host``), so that
    its CPU can be measured apart from its clients': ``host.port``, ``host.cpu_s()``."""

    def __enter__(self) -> StoreHost:
        import subprocess
        import sys

        self._p = subprocess.Popen(
            [sys.executable, "-c", _STORE_HOST],
            env={**os.environ, **QUICK_RESOLVER},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._p.stdout is not None
        self.port = int(self._p.stdout.readline())
        return self

    def cpu_s(self) -> float:
        """The host's CPU time so far (user + system)."""
        import psutil

        t = psutil.Process(self._p.pid).cpu_times()
        return float(t.user + t.system)

    def __exit__(self, *exc: object) -> None:
        assert self._p.stdin is not None
        self._p.stdin.close()
        self._p.wait(timeout=30)


def fan_out(
    host: StoreHost,
    script: str,
    children: list[list[str]],
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> tuple[list[dict[str, object]], float, float]:
    """Start ``script --child ARGS`` for each argument list; once each has said "ready",
    tell them all "go" and collect the JSON line each ends with. Returns their results,
    the store host's CPU seconds and the wall seconds from "go" to the last result."""
    import subprocess
    import sys

    kids = [
        subprocess.Popen(
            [sys.executable, script, "--child", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for args in children
    ]
    for k in kids:
        assert k.stdout is not None and k.stdout.readline().strip() == "ready"
    cpu0, t0 = host.cpu_s(), time.monotonic()
    for k in kids:
        assert k.stdin is not None
        k.stdin.write("go\n")
        k.stdin.flush()
    outs = [json.loads(k.communicate(timeout=timeout_s)[0].splitlines()[-1]) for k in kids]
    return outs, host.cpu_s() - cpu0, time.monotonic() - t0
