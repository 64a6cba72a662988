"""Which flaps of a node's network cost the node, at the default lease (issue 60, case 6).

3 nodes in network namespaces (``tests/net/_netlab.py``; root only), one agent and one
worker each, elastic (``--min-replicas 2``), TCPStore on node 0. Node 1 flaps over and
over, each flap followed by a rest: ``drop`` (its packets dropped at the bridge, its link
up: a path's flap) or ``link`` (its link taken down and up: its carrier lost, which the
kernel applies up to a second later). A flap *costs the node* when any agent declares it
lost within the rest. Results: ``bench/results/flaps.json`` and a table.

    python bench/flaps.py [--kind drop link] [--ms 100 200 250] [--flaps 10] [--rest 1.5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "net"))
from _common import table, write  # noqa: E402
from _netlab import NetLab, can_run  # noqa: E402

from fastft.runtime import read_events  # noqa: E402

NODES = 3
PORT = 29500


def _events(run: Path, name: str) -> list[dict]:
    try:
        return [e for e in read_events(run) if e["event"] == name]
    except FileNotFoundError:
        return []


def _wait(run: Path, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not _events(run, name):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {name} event within {timeout} s")
        time.sleep(0.1)


def one_kind(kind: str, lengths: list[float], flaps: int, rest: float) -> list[dict]:
    """One job: ``flaps`` flaps of node 1 of each length; the costs per length."""
    with tempfile.TemporaryDirectory() as d, NetLab(NODES) as lab:
        tmp = Path(d)
        store = ("--store", f"{lab.addr(0)}:{PORT}")
        run, procs = lab.start_job(tmp, 100000, *store, job="flaps")
        _wait(run, "probe_times")  # (after the start's link probe)
        rows = []
        for ms in lengths:
            lost = 0
            for _ in range(flaps):
                t = time.monotonic()
                if kind == "drop":
                    lab.drop(1)
                    time.sleep(ms / 1000)
                    lab.drop(1, False)
                else:
                    lab.cut(1)
                    time.sleep(ms / 1000)
                    lab.mend(1)
                time.sleep(rest)
                lost += any(e["mono"] > t for e in _events(run, "node_lost"))
            rows.append({"kind": kind, "flap_ms": ms, "flaps": flaps, "lost": lost})
            print(f"  {kind} {ms:g} ms: {lost} of {flaps} cost the node", flush=True)
        for p in procs:
            p.terminate()
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", nargs="+", default=["drop", "link"], choices=["drop", "link"])
    ap.add_argument("--ms", nargs="+", type=float, default=[100, 200, 250])
    ap.add_argument("--flaps", type=int, default=10)
    ap.add_argument("--rest", type=float, default=1.5)
    a = ap.parse_args()
    why = can_run()
    if why is not None:
        raise SystemExit(f"bench/flaps.py needs network namespaces: {why}")
    rows = [r for kind in a.kind for r in one_kind(kind, a.ms, a.flaps, a.rest)]
    meta = {"lease_ms": 300, "heartbeat_ms": 100, "rest_s": a.rest}
    path = write("flaps", rows, meta)
    print(table(rows, ["kind", "flap_ms", "flaps", "lost"]))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
