"""broadcast_bytes: a byte string of any length in one collective when it fits, two when
it does not, with receivers that do not know its size in advance."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from fastft.bus import host_store
from fastft.interrupt import Interrupter, broadcast_bytes

pytestmark = pytest.mark.timeout(60)


def _run(payload: bytes, first: int, src: int = 1, world: int = 3) -> list[bytes | None]:
    server = host_store()
    out: list[bytes | None] = [None] * world

    def rank(r: int) -> None:
        store = dist.PrefixStore(
            f"t{first}-{len(payload)}",
            dist.TCPStore(
                "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=20)
            ),
        )
        pg = dist.ProcessGroupGloo(store, r, world, datetime.timedelta(seconds=20))
        out[r] = broadcast_bytes(pg, payload if r == src else None, src, Interrupter(), first=first)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    return out


@pytest.mark.parametrize(
    "size, first",
    [(0, 64), (10, 64), (56, 64), (57, 64), (1000, 64), (70_000, 64 << 10)],
)
def test_every_rank_gets_the_bytes(size: int, first: int) -> None:
    payload = bytes((i * 7 + 3) % 256 for i in range(size))
    assert _run(payload, first) == [payload] * 3
