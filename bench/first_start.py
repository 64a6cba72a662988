"""The first start at scale (issue 35): N workers registering as joiners and forming the
first epoch, this code against an earlier commit's, side by side in one run.

N simulated workers (the real joiner's rounds, ``Joiners.rounds``, one thread and one store
client each, spread over a few processes) start together against one TCPStore hosted by a
process of its own. Reported: the time from the start until every worker holds the first
epoch's view (or that it did not form within the cap), and the store host's CPU over it.
The earlier commit runs from a git worktree of ``--before`` (default: the commit before
the first start read one counter instead of every joiner key).

    python bench/first_start.py [--sizes 64 256 1024] [--before REV] [--cap 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import StoreHost, fan_out, table, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def joiners(port: int, first: int, count: int, world: int, cap: float) -> None:
    """A child: ``count`` joiner threads (ranks first..); one JSON line: when each formed."""
    import datetime

    import torch.distributed as dist

    from fastft.protocol.keys import JobKeys
    from fastft.runtime.engine.coordinator import Coordinator

    try:  # (this code: the joiner's rounds, issue 63)
        from fastft.runtime.engine.joiners import Joiners
    except ImportError:  # (an earlier commit)
        Joiners = None  # noqa: N806

    keys = JobKeys("first")
    clients = [
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
        for _ in range(count)
    ]
    formed: dict[int, float] = {}
    stop = threading.Event()
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()

    def one(rank: int, store: object) -> None:
        c = Coordinator(store, keys, rank, 1, world, world)
        if Joiners is None:  # (before issue 63: the coordinator's own loop)
            view = c.form_as_joiner(  # type: ignore[attr-defined]
                start_timeout_s=3600, cancelled=stop.is_set, announce=lambda: None
            )
        else:  # the rounds a worker's executor carries out (nobody to announce to yet)
            joiners = Joiners(c)
            view = None
            for jr in joiners.rounds(joiners.register(3600, 5.0)):
                view = jr.view
                if stop.is_set():
                    break
        if view is not None:
            formed[rank] = time.monotonic() - t0

    threads = [
        threading.Thread(target=one, args=(first + i, s), daemon=True)
        for i, s in enumerate(clients)
    ]
    for t in threads:
        t.start()
    deadline = t0 + cap
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(5)
    print(json.dumps({"formed": formed}), flush=True)


def run(src: Path, world: int, procs: int, cap: float) -> dict[str, object]:
    per = -(-world // procs)
    children = [
        [str(first), str(min(per, world - first)), str(world), str(cap)]
        for first in range(0, world, per)
    ]
    with StoreHost() as host:
        outs, cpu, _ = fan_out(
            host,
            __file__,
            [[str(host.port), *c] for c in children],
            cap + 120,
            env={**os.environ, "PYTHONPATH": str(src)},
        )
    formed = [t for o in outs for t in o["formed"].values()]
    done = len(formed) == world
    return {
        "workers": world,
        "formed": f"{max(formed):.2f} s"
        if done
        else f"not in {cap:g} s ({len(formed)} of {world})",
        "formed_s": round(max(formed), 3) if done else None,
        "store_cpu_s": round(cpu, 2),
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        a = sys.argv[2:]
        joiners(int(a[0]), int(a[1]), int(a[2]), int(a[3]), float(a[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--before", default="HEAD~1", help="the earlier commit (a git revision)")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--cap", type=float, default=60.0, help="give up on a start after SEC")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), args.before],
            check=True,
        )
        try:
            for n in args.sizes:
                for label, src in (("before", old / "src"), ("this", ROOT / "src")):
                    row = {"code": label, **run(src, n, args.procs, args.cap)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)])
    print(table(rows, ["workers", "code", "formed", "store_cpu_s"]))
    path = write("first_start", rows, {"before": args.before, "procs": args.procs})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
