"""Prometheus metrics of a job (``fastft run --metrics-port PORT``, with the
``prometheus-client`` package: ``pip install 'fastft[metrics]'``).

Each agent follows the run's event log (``RUN_DIR/events.jsonl``, which its workers and
it append to) and serves what it folds out of it on ``http://ADDR:PORT/metrics``
(``--metrics-addr``, 127.0.0.1 by default):

=================================================  ========================================
``fastft_committed_steps``                          gauge: the steps committed so far
``fastft_steps_rolled_back_total``                  steps rolled back (one per epoch and step)
``fastft_faults_total{kind}``                       faults: an injection's kind, ``exception``,
                                                    ``exit``, ``hang``, ``stop``, ``reported``,
                                                    ``in_process``, ``node_lost``
``fastft_detection_seconds`` (histogram)            fault -> the first peer interrupted
``fastft_recovery_seconds`` (histogram)             fault -> the survivors' next commit
``fastft_restarts_total{how}``                      ``process`` (a new life) or ``in_process``
``fastft_heal_bytes_total``, ``fastft_heal_seconds``  state received by healing workers
``fastft_goodput_ratio``                            committed compute over wall time (the
                                                    steps committed x the median step time,
                                                    over the time since the first commit):
                                                    ETTR, the effective training time ratio
``fastft_bus_rejected_total{why}``                  bus frames not acted on (``malformed``,
                                                    ``forged``, ``replayed``), per stopped worker
=================================================  ========================================

:class:`Fold` is pure (events in, numbers out; unit-tested); :class:`Exporter` tails the
file and serves.
"""

from __future__ import annotations

import json
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastft.process.events import EVENTS_FILE

__all__ = ["Exporter", "Fold"]

_PROCESS = {"worker_exit": "exit", "worker_hung": "hang", "worker_stopped": "stop"}
_PENDING_S = 600.0
"""A fault not recovered from within this long stops being followed."""


def _rank(e: dict[str, Any]) -> int | None:
    if "rank" in e and isinstance(e["rank"], int):
        return int(e["rank"])
    kind, _, n = str(e.get("src", "")).partition(" ")
    return int(n) if kind in ("rank", "replica") and n.isdigit() else None


@dataclass
class _Pending:
    rank: int | None
    t: float
    step: int | None
    detected: bool = False


@dataclass
class Fold:
    """What the metrics say, folded from events one at a time (:meth:`add`). Faults of
    one life seen several ways (an injection, then its exit) count once."""

    committed: int = 0
    rolled_back: set[tuple[int, int]] = field(default_factory=set)
    faults: dict[str, int] = field(default_factory=dict)
    detection_s: list[float] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    heal_bytes: int = 0
    stragglers: int = 0
    heal_s: list[float] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    first_commit: float | None = None
    last_event: float | None = None
    _pending: list[_Pending] = field(default_factory=list)
    _faulty: dict[tuple[int | None, Any], float] = field(default_factory=dict)
    _last_commit: dict[str, float] = field(default_factory=dict)
    _gaps: deque[float] = field(default_factory=lambda: deque(maxlen=500))
    _stopped: bool = False

    def add(self, e: dict[str, Any]) -> None:
        name, t = e.get("event"), float(e.get("mono", 0.0))
        self.last_event = t
        if name == "stop":
            self._stopped = True
        elif name == "commit":
            self._commit(e, t)
        elif name == "rollback":
            self.rolled_back.add((int(e.get("epoch", 0)), int(e.get("step", 0))))
        elif name in ("interrupt", "peer_fault"):
            r = _rank(e)
            for p in self._pending:
                if not p.detected and p.rank != r and t >= p.t:
                    p.detected = True
                    self.detection_s.append(t - p.t)
        elif name in ("straggler", "slow_link"):
            self.stragglers += 1
        elif name == "restart":
            self.restarts["process"] = self.restarts.get("process", 0) + 1
        elif name == "heal" and e.get("role") == "fetch":
            self.heal_bytes += int(e.get("bytes", 0))
            self.heal_s.append(float(e.get("heal_ms", 0.0)) / 1e3)
        elif name == "worker_stop":
            for why in ("malformed", "forged", "replayed"):
                n = int((e.get("rejected") or {}).get(why) or 0)
                self.rejected[why] = self.rejected.get(why, 0) + n
        kind = self._fault_kind(e)
        if kind is not None:
            self._fault(e, kind, t)

    def _commit(self, e: dict[str, Any], t: float) -> None:
        step = int(e.get("step", -1))
        self.committed = max(self.committed, step + 1)
        if self.first_commit is None:
            self.first_commit = t
        src = str(e.get("src"))
        prev = self._last_commit.get(src)
        if prev is not None:
            self._gaps.append(t - prev)
        self._last_commit[src] = t
        r = _rank(e)
        for p in list(self._pending):
            if p.rank != r and (p.step is None or step >= p.step) and t >= p.t:
                self.recovery_s.append(t - p.t)
                self._pending.remove(p)
        self._pending = [p for p in self._pending if t - p.t < _PENDING_S]

    def _fault_kind(self, e: dict[str, Any]) -> str | None:
        name = e.get("event")
        if name == "injected":
            kind = str(e.get("kind", "injected"))
            return None if kind == "slow" else kind  # (a straggler: fastft_stragglers_total)
        if name == "local_fault" and "CollectiveFailed" not in str(e.get("cause", "")):
            return "exception"
        if name == "reported_fault":
            return "reported"
        if name == "restarted_in_process":
            return "in_process"
        if name == "node_lost":
            return "node_lost"
        if name in _PROCESS and not self._stopped:
            if name == "worker_exit" and e.get("exit_code") in (0, 88):
                return None
            if e.get("signal") == 2:
                return None
            return _PROCESS[str(name)]
        return None

    def _fault(self, e: dict[str, Any], kind: str, t: float) -> None:
        if kind == "in_process":
            self.restarts["in_process"] = self.restarts.get("in_process", 0) + 1
        life = (_rank(e), e.get("incarnation"))
        seen = self._faulty.get(life)
        self._faulty[life] = t
        if (
            seen is not None
            and life[1] is not None
            and (kind in _PROCESS.values() or t - seen < 1.0)
        ):
            return  # the same fault of the same life, seen another way
        self.faults[kind] = self.faults.get(kind, 0) + 1
        step = e.get("step")
        self._pending.append(_Pending(_rank(e), t, int(step) if isinstance(step, int) else None))

    @property
    def goodput(self) -> float | None:
        """Committed compute over wall time since the first commit (None before two)."""
        if self.first_commit is None or self.last_event is None or not self._gaps:
            return None
        span = self.last_event - self.first_commit
        if span <= 0:
            return None
        return min(1.0, self.committed * statistics.median(self._gaps) / span)


class Exporter:
    """Follows ``RUN_DIR/events.jsonl`` and serves the :class:`Fold` of it on
    ``addr:port`` (port 0: one the OS picks; :attr:`port` says which)."""

    def __init__(self, run_dir: str | Path, addr: str, port: int) -> None:
        try:
            import prometheus_client as pc
        except ImportError as e:  # (checked at start: fastft run --metrics-port)
            raise RuntimeError(
                "--metrics-port needs the prometheus-client package: pip install 'fastft[metrics]'"
            ) from e
        self.path = Path(run_dir) / EVENTS_FILE
        self.fold = Fold()
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = b""
        reg = pc.CollectorRegistry()
        self._m = _instruments(pc, reg)
        self._seen = {"detection": 0, "recovery": 0, "heal": 0}
        self._server, self._thread = pc.start_http_server(port, addr=addr, registry=reg)
        self.port = self._server.server_port
        self._stop = threading.Event()
        self._tail = threading.Thread(target=self._run, name="fastft-metrics", daemon=True)
        self._tail.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.update()

    def update(self) -> None:
        """Read what the log gained since the last call and refresh the metrics."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        with self._lock:
            for line in lines:
                try:
                    self.fold.add(json.loads(line))
                except (ValueError, TypeError):
                    continue  # (a torn or foreign line: skipped)
            self._publish()

    def _publish(self) -> None:
        f, m = self.fold, self._m
        m["committed"].set(f.committed)
        m["rolled_back"].set(len(f.rolled_back))
        for kind, n in f.faults.items():
            m["faults"].labels(kind=kind).set(n)
        for how, n in f.restarts.items():
            m["restarts"].labels(how=how).set(n)
        for why, n in f.rejected.items():
            m["rejected"].labels(why=why).set(n)
        m["heal_bytes"].set(f.heal_bytes)
        m["stragglers"].set(f.stragglers)
        for key, values, hist in (
            ("detection", f.detection_s, m["detection"]),
            ("recovery", f.recovery_s, m["recovery"]),
            ("heal", f.heal_s, m["heal_s"]),
        ):
            for v in values[self._seen[key] :]:
                hist.observe(v)
            self._seen[key] = len(values)
        if f.goodput is not None:
            m["goodput"].set(f.goodput)

    def close(self) -> None:
        self._stop.set()
        self._tail.join(timeout=2)
        self._server.shutdown()
        self._server.server_close()


def _instruments(pc: Any, reg: Any) -> dict[str, Any]:
    """The metrics. Totals that the fold recomputes are gauges named ``*_total`` (a
    Counter cannot be set); histograms get each new observation once."""
    buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

    def total(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return pc.Gauge(name, doc, labels, registry=reg)

    return {
        "committed": pc.Gauge("fastft_committed_steps", "steps committed", registry=reg),
        "rolled_back": total("fastft_steps_rolled_back_total", "steps rolled back"),
        "faults": total("fastft_faults_total", "faults by kind", ("kind",)),
        "restarts": total("fastft_restarts_total", "restarts", ("how",)),
        "rejected": total("fastft_bus_rejected_total", "bus frames not acted on", ("why",)),
        "heal_bytes": total("fastft_heal_bytes_total", "bytes received by healing workers"),
        "stragglers": total("fastft_stragglers_total", "workers or links named stragglers"),
        "detection": pc.Histogram(
            "fastft_detection_seconds",
            "fault -> first peer interrupted",
            buckets=buckets,
            registry=reg,
        ),
        "recovery": pc.Histogram(
            "fastft_recovery_seconds",
            "fault -> survivors' next commit",
            buckets=buckets,
            registry=reg,
        ),
        "heal_s": pc.Histogram(
            "fastft_heal_seconds", "a heal's duration (receiver)", buckets=buckets, registry=reg
        ),
        "goodput": pc.Gauge(
            "fastft_goodput_ratio", "committed compute over wall time (ETTR)", registry=reg
        ),
    }
