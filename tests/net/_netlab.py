"""Nodes in network namespaces (issue 50): each node's agent and workers in a namespace
of its own, joined by veth pairs to a bridge in a hub namespace, so that a test can cut a
node's link (``cut``), restore it (``mend``) or throttle it (``throttle``, ``tc tbf``).

Everything the lab creates (namespaces, veth pairs, the bridge, every process it started
and their sessions) is removed when it closes, whatever happened. Root only; the tests
skip elsewhere."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["NetLab", "can_run"]

SUBNET = "10.77.0"


def can_run() -> str | None:
    """Why the lab cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    try:
        _ip("netns", "add", f"fftprobe{os.getpid()}")
        _ip("netns", "del", f"fftprobe{os.getpid()}")
    except subprocess.CalledProcessError as e:
        return f"ip netns does not work here: {e.stderr.strip()}"
    return None


def _ip(*args: str) -> str:
    return subprocess.run(
        ["ip", *args], check=True, capture_output=True, text=True, timeout=10
    ).stdout


def _session(sid: int) -> list[int]:
    """Every process of session ``sid`` (a process the lab started in a session of its
    own: its workers and their children)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                out.append(int(d))
    return out


class NetLab:
    """``nodes`` namespaces on one bridge; node ``i`` has address :meth:`addr` (i)."""

    def __init__(self, nodes: int) -> None:
        self.tag = f"x{os.getpid() % 100000}"
        self.hub = f"{self.tag}hub"
        self.ns = [f"{self.tag}n{i}" for i in range(nodes)]
        self.procs: list[subprocess.Popen[Any]] = []

    def inner(self, i: int) -> str:
        """Node ``i``'s end of its link (in its namespace)."""
        return f"v{self.tag}{i}"

    def _outer(self, i: int) -> str:
        return f"p{self.tag}{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> NetLab:
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.ns):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", self.inner(i), "type", "veth", "peer", "name", self._outer(i))
                _ip("link", "set", self.inner(i), "netns", ns)
                _ip("link", "set", self._outer(i), "netns", self.hub)
                _ip("-n", self.hub, "link", "set", self._outer(i), "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", self.inner(i))
                _ip("-n", ns, "link", "set", self.inner(i), "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def popen(self, i: int, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in node ``i``'s namespace, in a session of its own."""
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.inner(i), **kw.pop("env", {})}
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[i], *cmd], start_new_session=True, env=env, **kw
        )
        self.procs.append(p)
        return p

    def start_job(
        self,
        tmp: Path,
        steps: int,
        *flags: str,
        job: str,
        floor: int = 2,
        nodes: int | None = None,
    ) -> tuple[Path, list[subprocess.Popen[Any]]]:
        """One agent with one worker of the demo in each of the first ``nodes`` namespaces
        (every one: None), ``--min-replicas floor``, a step of 50 ms, logs in
        ``tmp/nodeN.log``, the run in ``tmp/run``; ``flags`` name the control plane
        (``--store``, ``--control``) and the rest."""
        from fastft.protocol.auth import JobSecret

        run = tmp / "run"
        run.mkdir()
        secret = JobSecret.draw().save(tmp / "job.secret")
        nodes, procs = nodes or len(self.ns), []
        for node in range(nodes):
            cmd = [
                sys.executable, "-m", "fastft.cli", "run", "--nproc", "1",
                "--nnodes", str(nodes), "--node-rank", str(node),
                "--job-secret-file", str(secret), "--job", job, "--run-dir", str(run),
                "--check-every", "1", "--min-replicas", str(floor), *flags,
                "-m", "fastft.demo.train", "--", "--steps", str(steps),
                "--step-time", "0.05", "--out", str(run / "out"),
            ]  # fmt: skip
            log = open(tmp / f"node{node}.log", "w")  # noqa: SIM115 - closed with the lab
            procs.append(self.popen(node, cmd, stdout=log, stderr=log))
        return run, procs

    def cut(self, i: int) -> None:
        """Node ``i``'s link goes down (at the bridge: the node sees its own link up)."""
        _ip("-n", self.hub, "link", "set", self._outer(i), "down")

    def mend(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self._outer(i), "up")

    def drop(self, i: int, on: bool = True) -> None:
        """Node ``i``'s packets are dropped at the bridge (``on``), or pass again: a flap
        of the path with no carrier change. A link set down and up (:meth:`cut`,
        :meth:`mend`) costs its node ~1 s more than it was down: the kernel applies a
        carrier's return up to a second later (linkwatch), so a 50 ms cut is a 1 s
        outage."""
        state = "0" if on else "3"  # (a bridge port disabled / forwarding)
        subprocess.run(
            ["bridge", "-n", self.hub, "link", "set", "dev", self._outer(i), "state", state],
            check=True,
            capture_output=True,
            timeout=10,
        )

    def block(self, i: int, j: int) -> None:
        """Node ``i`` can no longer reach node ``j`` (a blackhole route in ``i``'s
        namespace: its packets to ``j`` vanish, silently); both still reach the others.
        (No nftables, tc classifier or action here: routing is what this kernel has.)"""
        _ip("-n", self.ns[i], "route", "add", "blackhole", f"{self.addr(j)}/32")

    def unblock(self, i: int, j: int) -> None:
        _ip("-n", self.ns[i], "route", "del", "blackhole", f"{self.addr(j)}/32")

    def throttle(self, i: int, rate: str) -> None:
        """Node ``i``'s outgoing traffic shaped to ``rate`` (``tc tbf``, e.g. ``"2mbit"``)."""
        subprocess.run(
            ["tc", "-n", self.ns[i], "qdisc", "replace", "dev", self.inner(i), "root", "tbf",
             "rate", rate, "burst", "32kbit", "latency", "400ms"],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip

    def left(self) -> list[int]:
        """Processes of the lab's sessions still running."""
        return [pid for p in self.procs for pid in _session(p.pid)]

    def close(self) -> None:
        for p in self.procs:  # every process of the sessions the lab started, by PID
            for pid in _session(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in [*self.ns, self.hub]:
            try:
                _ip("netns", "del", ns)  # (its veth ends and the bridge go with it)
            except subprocess.CalledProcessError:
                pass
