"""How fastft's NATS clients connect (:mod:`fastft.bus.natsio` holds them): nats-py's
settings, a check that a server of the list accepts connections at all, one line that
says what is wrong, and retries while JetStream does not answer yet."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from fastft.errors import StoreUnreachable

__all__ = ["PING_S", "RECONNECT_WAIT_S", "client_options", "explain", "reachable", "with_retries"]

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 0.05
"""How long the client waits before it tries the next server after losing one."""
PING_S = 1.0
"""The client pings its server this often, and leaves it after 2 pings unanswered (an idle
connection to a server cut off; nats-py's default waits 2 minutes for each)."""


def client_options(timeout_s: float) -> dict[str, Any]:
    """nats-py's connection settings fastft's clients share: reconnect at once and for
    ever, and leave a server whose pings go unanswered (see the module)."""
    return {
        "connect_timeout": max(1, int(min(timeout_s, 5))),
        "reconnect_time_wait": RECONNECT_WAIT_S,
        "max_reconnect_attempts": -1,
        "allow_reconnect": True,
        "ping_interval": PING_S,
        "max_outstanding_pings": 2,
    }


def explain(servers: list[str], e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0][:200]
    where = ",".join(servers)
    if "jetstream" in text.lower() or "503" in text or "ServiceUnavailable" in text:
        return (
            f"the NATS servers at {where} have no JetStream ({text}): start them with "
            "JetStream on (nats-server -js, or fastft nats up)"
        )
    return f"no NATS server answers at {where} ({text}): check --control"


def reachable(servers: list[str], wait_s: float) -> None:
    """Fail at once (after ``wait_s`` of retries) if no server of the list accepts a
    connection: the client itself would retry forever."""
    deadline = time.monotonic() + wait_s
    while True:
        errors = []
        for url in servers:
            host, _, port = url.split("://", 1)[1].rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port or 4222)), timeout=2.0):
                    return
            except (OSError, ValueError) as e:
                errors.append(f"{url}: {getattr(e, 'strerror', None) or e}")
        if time.monotonic() >= deadline:
            raise StoreUnreachable(
                f"no NATS server answers at {','.join(servers)} ({'; '.join(errors)[:300]}): "
                "check --control"
            )
        time.sleep(0.1)


async def with_retries(call: Any, timeout_s: float) -> Any:
    """``await call()``, tried again for up to ``timeout_s`` while JetStream does not
    answer yet (a cluster that just started, or is electing its leader on a loaded
    machine, times out or has no responders for a few seconds)."""
    import asyncio

    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await call()
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError) as e:
            if loop.time() + 0.5 > deadline:
                raise
            log.info("nats: JetStream not answering yet (%s); trying again", type(e).__name__)
            await asyncio.sleep(0.5)
