"""The lighthouse process that ``fastft run --torchft fastft`` starts on node 0: a
:class:`~fastft.integrations.torchft.lighthouse.BusLighthouse` on the job's bus, its
address published in the job's store."""

from __future__ import annotations

import logging
import threading
from typing import Any

from fastft.integrations.torchft.lighthouse import BusLighthouse, lighthouse_key
from fastft.integrations.torchft.quorum import LighthouseOptions, parse_replica_id
from fastft.protocol.messages import JoinRequest, RollbackRequest

__all__ = ["main", "parser"]


def parser() -> Any:
    """The lighthouse process's flags (given by the agent)."""
    import argparse

    ap = argparse.ArgumentParser(prog="fastft-lighthouse")
    ap.add_argument("--store", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--bind", default="127.0.0.1:0")
    ap.add_argument("--advertise", default="127.0.0.1")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--heartbeat-ms", type=int, default=5000)
    ap.add_argument("--join-ms", type=int, default=60000)
    ap.add_argument("--first-quorum", type=int, default=0)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--secret-file", required=True, help="the job secret (mode 0600)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The lighthouse process (``fastft.integrations.torchft.lighthouse_main.main``) that
    ``fastft run --torchft fastft`` starts on node 0. It is a bus subscriber like any other
    and publishes its address in the job's store. It runs apart from the agent because
    gRPC's threads do not survive the agent's fork of a worker."""
    import secrets
    import signal

    from fastft.bus import BusConfig, connect_store, open_bus
    from fastft.process.events import EventLog
    from fastft.protocol import NO_RANK, Role
    from fastft.protocol.auth import JobSecret

    a = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s lighthouse %(message)s")
    events = EventLog(a.run_dir, "lighthouse")
    store = connect_store(a.store, wait_s=30)
    bus = open_bus(
        store,
        BusConfig(
            job=a.job,
            rank=NO_RANK,
            incarnation=secrets.randbits(62) | 1,
            role=Role.MONITOR,
            secret=JobSecret.load(a.secret_file),
        ),
    )

    def announce(replica_id: str) -> None:
        life = parse_replica_id(replica_id)
        if life is not None and not bus.closed:
            bus.broadcast(
                JoinRequest(
                    job=a.job, epoch=0, rank=life[0], incarnation=life[1], role=Role.MONITOR
                )
            )
            events.emit("lighthouse_join", rank=life[0], incarnation=life[1])

    def waiting(replica_id: str, step: int, quorum_id: int) -> None:
        life = parse_replica_id(replica_id)
        if life is not None and not bus.closed:
            bus.broadcast(
                RollbackRequest(
                    job=a.job,
                    epoch=max(quorum_id, 0),
                    rank=life[0],
                    incarnation=life[1],
                    step=max(step, 0),
                    role=Role.MONITOR,
                    reason="waiting in the lighthouse",
                )
            )

    lh = BusLighthouse(
        a.bind,
        LighthouseOptions(a.min_replicas, a.join_ms, 100, a.heartbeat_ms, a.first_quorum),
        emit=events.emit,
        on_join=announce,
        on_waiting=waiting,
    )
    bus.subscribe(lh.on_message)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    with lh, bus.start():
        address = f"http://{a.advertise}:{lh.port}"
        store.set(lighthouse_key(a.job), address)
        events.emit("lighthouse_start", address=address, options=repr(lh.options))
        stop.wait()
    events.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
