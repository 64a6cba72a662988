"""How long the kernel takes to tear down a SIGKILLed process before anyone can see it died.

The node agent learns of a worker's death from ``waitid`` and the peers from their reset
connections; both happen only after the kernel has freed the process's memory, so this is
the floor of SIGKILL detection. Each case starts a process, waits until it is ready, kills
it and times SIGKILL -> ``waitid`` in the parent:

* ``python``: a bare interpreter;
* ``import torch``: torch imported, nothing allocated;
* ``4.2M MLP + Adam``: the recovery benchmark's large model after 3 training steps;
* ``+ 400 MB tensor``: torch plus one 400 MB tensor, with and without
  ``THP_MEM_ALLOC_ENABLE=1`` (torch asks for transparent huge pages for allocations of
  2 MB and more, which the kernel frees 512 pages at a time).

    python bench/kill_teardown.py [--trials 5]

Results: bench/results/kill_teardown.json and a table.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402

READY = "print('ready', flush=True); import sys; sys.stdin.read()"
MLP = """
import torch
from fastft.demo.train import batch, build
torch.set_num_threads(1)
m = build(1024, 0, 5)
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
for s in range(3):
    x, y = batch(s, 0, 96)
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
"""
CASES = [  # label, code, extra environment
    ("python", "", {}),
    ("import torch", "import torch", {}),
    ("4.2M MLP + Adam", MLP, {}),
    ("4.2M MLP + Adam, THP", MLP, {"THP_MEM_ALLOC_ENABLE": "1"}),
    ("torch + 400 MB tensor", "import torch; t = torch.ones(100_000_000)", {}),
    (
        "torch + 400 MB tensor, THP",
        "import torch; t = torch.ones(100_000_000)",
        {"THP_MEM_ALLOC_ENABLE": "1"},
    ),
]


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def kill_once(code: str, env: dict[str, str]) -> tuple[float, int]:
    """(ms from SIGKILL to waitid, anonymous RSS in MiB at the kill)."""
    p = subprocess.Popen(
        [sys.executable, "-c", f"{code}\n{READY}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
        text=True,
    )
    try:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the child did not start: {code!r}")
        anon = _status_kb(p.pid, "RssAnon") >> 10
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        os.waitid(os.P_PID, p.pid, os.WEXITED)
        return (time.monotonic() - t0) * 1e3, anon
    finally:
        if p.returncode is None and p.poll() is None:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()
    rows = []
    for label, code, env in CASES:
        runs = [kill_once(code, env) for _ in range(a.trials)]
        ms = [r[0] for r in runs]
        rows.append(
            {
                "process": label,
                "n": len(ms),
                "anon_rss_mib": max(r[1] for r in runs),
                "p50_ms": round(statistics.median(ms), 1),
                "max_ms": round(max(ms), 1),
            }
        )
        print(rows[-1], flush=True)
    path = write("kill_teardown", rows, {})
    print()
    print(table(rows, ["process", "n", "anon_rss_mib", "p50_ms", "max_ms"]))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
