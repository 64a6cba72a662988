"""The metrics' fold over the event log (pure), and the exporter served over real HTTP on
127.0.0.1 (issue 24)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from fastft.metrics import Exporter, Fold


def ev(event: str, mono: float, src: str = "rank 0", **kw: object) -> dict[str, object]:
    return {"event": event, "mono": mono, "src": src, **kw}


HISTORY = [
    ev("commit", 1.0, step=0),
    ev("commit", 1.0, "rank 1", step=0),
    ev("commit", 1.1, step=1),
    ev("commit", 1.1, "rank 1", step=1),
    ev("injected", 1.15, "rank 1", kind="sigkill", step=2, incarnation=7),
    ev("worker_exit", 1.16, "agent 0", rank=1, incarnation=7, exit_code=None, signal=9),
    ev("interrupt", 1.17, step=2),
    ev("rollback", 1.18, epoch=1, step=2),
    ev("restart", 1.2, "agent 0", rank=1),
    ev("heal", 1.4, "rank 1", role="fetch", bytes=1000, heal_ms=20.0),
    ev("commit", 1.45, step=2),
    ev("local_fault", 1.5, "rank 1", step=3, incarnation=9, cause="ValueError: x"),
    ev("interrupt", 1.51, step=3),
    ev("rollback", 1.52, epoch=2, step=3),
    ev("commit", 1.6, step=3),
    ev("worker_stop", 1.7, rejected={"malformed": 2, "forged": 1, "replayed": 0}),
    ev("stop", 1.8, "agent 0", signal=2),
    ev("worker_exit", 1.81, "agent 0", rank=0, incarnation=3, exit_code=None, signal=9),
]


def test_the_fold_counts_each_fault_once_and_times_its_detection_and_recovery():
    f = Fold()
    for e in HISTORY:
        f.add(e)
    assert f.committed == 4 and len(f.rolled_back) == 2
    assert f.faults == {"sigkill": 1, "exception": 1}  # the exit is the injection; the stop none
    assert f.detection_s == pytest.approx([0.02, 0.01])
    assert f.recovery_s == pytest.approx([0.30, 0.10])
    assert f.restarts == {"process": 1} and f.heal_bytes == 1000
    assert f.rejected == {"malformed": 2, "forged": 1, "replayed": 0}
    # 4 steps x the median gap between a member's commits (0.1, 0.35, 0.15; 0.1) over
    # the 0.81 s since the first commit
    assert f.goodput == pytest.approx(4 * 0.125 / 0.81)


def test_the_exporter_serves_the_metrics_over_http(tmp_path):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in HISTORY[:12]))
    x = Exporter(tmp_path, "127.0.0.1", 0)
    try:
        x.update()
        with (tmp_path / "events.jsonl").open("a") as f:  # the log grows, a line torn
            f.write("".join(json.dumps(e) + "\n" for e in HISTORY[12:]) + '{"event": "com')
        x.update()
        url = f"http://127.0.0.1:{x.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    finally:
        x.close()
    assert "fastft_committed_steps 4.0" in text
    assert 'fastft_faults_total{kind="sigkill"} 1.0' in text
    assert 'fastft_faults_total{kind="exception"} 1.0' in text
    assert "fastft_recovery_seconds_count 2.0" in text
    assert "fastft_steps_rolled_back_total 2.0" in text
    assert 'fastft_bus_rejected_total{why="forged"} 1.0' in text
    assert "fastft_goodput_ratio 0.617" in text
