"""Multi-node jobs on one machine for the node-loss tests and the benchmark: a "node" is one
``fastft run --nnodes N --node-rank n`` agent with its workers, in a process group of its
own. A node is lost by SIGKILL of its whole group; partitioned by SIGSTOP of the group,
and back with SIGCONT. Every blocking call has a timeout; ``close()`` kills what is left,
by process group, and says whether anything was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fastft.bus.natscluster import free_port
from fastft.protocol.auth import JobSecret
from fastft.runtime import read_events

LEASE = ("--node-lease-misses", "5")
"""500 ms leases: the tests' 3 agents share 2 cores with the workers (and 3 NATS servers),
and an agent descheduled for 300 ms would be declared lost (its workers restarted, which
the checks would count); bench/node_loss.py measures the default (300 ms)."""


class Nodes:
    def __init__(
        self,
        run: Path,
        nnodes: int,
        *,
        nproc: int = 1,
        flags: tuple[str, ...] = (),
        steps: int = 30,
        train: tuple[str, ...] = (),
        control: str | None = None,
    ) -> None:
        self.run = run
        self.nnodes = nnodes
        self.port = free_port()
        plane = ("--control", control) if control else ("--store", f"127.0.0.1:{self.port}")
        self.procs: dict[int, list[subprocess.Popen[bytes]]] = {}
        self.standbys: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: set[int] = set()
        run.mkdir(parents=True, exist_ok=True)
        self.secret = run / "job.secret"  # one file every node's agent reads
        JobSecret.draw().save(self.secret)
        self.cmd = [
            *(sys.executable, "-m", "fastft.cli", "run", "--nproc", str(nproc)),
            *("--nnodes", str(nnodes), *plane, "--job-secret-file", str(self.secret)),
            *("--job", run.name, "--run-dir", str(run), "--check-every", "1", *LEASE, *flags),
            *("-m", "fastft.demo.train", "--", "--steps", str(steps)),
            *("--out", str(run / "out"), *train),
        ]

    def start(self, node: int, *, standby: bool = False) -> subprocess.Popen[bytes]:
        """Node ``node``'s agent (a new life of the node); ``standby``: ``fastft run
        --standby``, warm and waiting for :meth:`go` (not the node's agent until then)."""
        lives = self.procs.setdefault(node, [])
        name = f"node{node}-{len(lives)}{'-standby' if standby else ''}.log"
        log = open(self.run / name, "wb")  # noqa: SIM115
        cmd = [*self.cmd]
        cmd.insert(cmd.index("--nnodes"), "--node-rank")
        cmd.insert(cmd.index("--nnodes"), str(node))
        if standby:
            cmd.insert(cmd.index("--nnodes"), "--standby")
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        if standby:
            self.standbys[node] = p
        else:
            lives.append(p)
        return p

    def go(self, node: int) -> None:
        """Tell node ``node``'s standby to take the node over: its agent from now on."""
        p = self.standbys.pop(node)
        assert p.stdin is not None
        p.stdin.write(b"{}\n")
        p.stdin.close()
        self.procs[node].append(p)

    def start_all(self) -> None:
        for n in range(self.nnodes):
            self.start(n)

    def agent(self, node: int) -> subprocess.Popen[bytes]:
        return self.procs[node][-1]

    def signal(self, node: int, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.killed.add(self.agent(node).pid)
        os.killpg(self.agent(node).pid, sig)

    def events(self) -> list[dict]:
        try:
            return read_events(self.run)
        except FileNotFoundError:
            return []

    def wait_event(self, pred, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if pred(e):
                    return e
            if any(p.poll() not in (None, 0) and p.pid not in self.killed for p in self.live()):
                raise AssertionError(f"an agent failed: {self.logs()}")
            time.sleep(0.05)
        raise AssertionError(f"no such event within {timeout} s: {self.logs()}")

    def wait_commit(self, step: int, timeout: float = 90) -> dict:
        return self.wait_event(lambda e: e["event"] == "commit" and e["step"] >= step, timeout)

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [lives[-1] for lives in self.procs.values()]

    def wait(self, timeout: float = 120) -> dict[int, int | None]:
        """Wait for every node's latest agent; their exit codes."""
        deadline = time.monotonic() + timeout
        for p in self.live():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {n: lives[-1].poll() for n, lives in self.procs.items()}

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-2500:]}"
            for f in sorted(self.run.glob("node*.log"))
        )

    def leftovers(self) -> list[int]:
        """Process groups of this job's agents that still have a process in them."""
        left = []
        for lives in [*self.procs.values(), list(self.standbys.values())]:
            for p in lives:
                try:
                    os.killpg(p.pid, 0)
                    left.append(p.pid)
                except ProcessLookupError:
                    pass
        return left

    def describe(self, pgids: list[int]) -> str:
        """The processes left in ``pgids`` (pid, state, command line), for a failure."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[2]) in pgids:
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                    out.append(f"{d.name} {fields[0]} {cmd}")
            except (OSError, IndexError, ValueError):
                continue
        return "\n".join(out)

    def close(self) -> list[int]:
        """Kill every group still there (SIGCONT first: a stopped one); what was left."""
        left = self.leftovers()
        for pgid in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
        for lives in [*self.procs.values(), list(self.standbys.values())]:
            for p in lives:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        return left
