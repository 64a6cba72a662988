"""How long the agent waits for a hung worker to print its stacks before it kills it
(``fastft.launch.procs.children.await_signal_taken``): until the worker has taken the signal,
at most ``STACKS_MAX_S``. That wait is on a fixed world's recovery path from a hang (the
replacement starts at the hung worker's exit). Three cases, each timed over trials:

* ``running``: a GIL-holding loop with faulthandler registered (the real case);
* ``blocked``: the signal stays pending (blocked): the wait ends at its limit;
* ``gone``: the process already exited: no wait.

    python bench/hang_kill.py [--trials 10]

Results: bench/results/hang_kill.json and a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import summary_ms, table, write  # noqa: E402

from fastft.launch.procs.children import STACKS_MAX_S, await_signal_taken  # noqa: E402
from fastft.process.beat import STACKS_SIGNAL  # noqa: E402

HUNG = r"""
import faulthandler, signal, sys
sig = int(sys.argv[2])
if sys.argv[1] == "block":
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
faulthandler.register(sig, all_threads=True)
print("ready", flush=True)
while True:
    pass
"""


def _start(mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HUNG, mode, str(int(STACKS_SIGNAL))],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def trial(case: str) -> tuple[float, bool]:
    if case == "gone":
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        t0 = time.monotonic()
        taken = await_signal_taken(p.pid, STACKS_SIGNAL)
        return time.monotonic() - t0, taken
    p = _start("block" if case == "blocked" else "run")
    try:
        p.send_signal(STACKS_SIGNAL)
        t0 = time.monotonic()
        taken = await_signal_taken(p.pid, STACKS_SIGNAL)
        return time.monotonic() - t0, taken
    finally:
        p.kill()
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for case in ("running", "blocked", "gone"):
        waits, taken = [], []
        for _ in range(args.trials):
            w, t = trial(case)
            waits.append(w)
            taken.append(t)
        rows.append({"case": case, **summary_ms(waits), "taken": sum(taken)})
    path = write("hang_kill", rows, {"trials": args.trials, "limit_ms": STACKS_MAX_S * 1e3})
    print(table(rows, ["case", "n", "p50_ms", "p99_ms", "max_ms", "taken"]))
    print(f"limit {STACKS_MAX_S * 1e3:.0f} ms; results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
