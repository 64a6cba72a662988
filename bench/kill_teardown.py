"""How long the kernel takes to tear down a SIGKILLed process before anyone can see it died,
and how much sooner the agent's exit trace sees it.

``waitid`` in the parent and the peers' reset connections both come only after the kernel
has freed the process's memory: that was the floor of SIGKILL detection. The agent's exit
trace (``fastft.launch.procs.exit_trace``) stops a traced sentinel thread of the worker at the
start of its exit, before the teardown. Each case starts a process, waits until it is
ready, kills it and times, in separate trials, SIGKILL -> ``waitid`` in the parent
(``waitid_*``) and SIGKILL -> the exit trace's report (``exit_trace_*``, the child runs
fastft's sentinel):

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
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.path.dirname(__file__))
from _common import table, write  # noqa: E402

from fastft.launch.procs.exit_trace import ExitTracer  # noqa: E402

READY = "print('ready', flush=True); import sys; sys.stdin.read()"
SENTINEL = (
    "import runpy, sys; "
    f"runpy.run_path({str(ROOT / 'src/fastft/process/sentinel.py')!r})"
    "['start_exit_sentinel'](sys.argv[1])"
)
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


def kill_once(code: str, env: dict[str, str], traced: bool) -> tuple[float, int]:
    """(ms from SIGKILL to waitid, or to the exit trace's report when ``traced``;
    anonymous RSS in MiB at the kill)."""
    tmp = tempfile.mkdtemp(prefix="fastft-kill-")
    path = os.path.join(tmp, "sentinel")
    p = subprocess.Popen(
        [sys.executable, "-c", f"{SENTINEL if traced else ''}\n{code}\n{READY}", path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
        text=True,
    )
    seen: list[float] = []
    done = threading.Event()
    tracer = ExitTracer(poll_s=0.005)
    try:
        if traced:
            tracer.watch(
                p.pid,
                path,
                lambda: p.returncode is None,
                lambda code, sig, t: seen.append(time.monotonic()),
                lambda code, sig, t: done.set(),
            )
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the child did not start: {code!r}")
        deadline = time.monotonic() + 10
        while traced and not tracer.attached:
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot trace the child ({tracer.refused or 'no sentinel'})")
            time.sleep(0.005)
        anon = _status_kb(p.pid, "RssAnon") >> 10
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        if traced:
            done.wait(10)
        os.waitid(os.P_PID, p.pid, os.WEXITED)
        end = seen[0] if traced else time.monotonic()
        return (end - t0) * 1e3, anon
    finally:
        if p.returncode is None and p.poll() is None:
            p.kill()
            p.wait()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()
    rows = []
    for label, code, env in CASES:
        plain = [kill_once(code, env, traced=False) for _ in range(a.trials)]
        traced = [kill_once(code, env, traced=True)[0] for _ in range(a.trials)]
        ms = [r[0] for r in plain]
        rows.append(
            {
                "process": label,
                "n": len(ms),
                "anon_rss_mib": max(r[1] for r in plain),
                "waitid_p50_ms": round(statistics.median(ms), 1),
                "waitid_max_ms": round(max(ms), 1),
                "exit_trace_p50_ms": round(statistics.median(traced), 2),
                "exit_trace_max_ms": round(max(traced), 2),
            }
        )
        print(rows[-1], flush=True)
    path = write("kill_teardown", rows, {})
    print()
    print(table(rows, list(rows[0])))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
