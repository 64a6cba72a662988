"""What ManagerFFT passes to torchft's Manager under ``fastft run``: its defaults, and the
user's own settings kept. torchft's constructor is stopped right after it is called."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torchft")

from torchft import ProcessGroupGloo  # noqa: E402
from torchft.manager import Manager  # noqa: E402

from fastft.integrations.torchft import ManagerFFT  # noqa: E402
from fastft.runtime.contract import ENV  # noqa: E402


class _Stop(Exception):
    pass


@pytest.fixture
def manager_kwargs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_init(self: Manager, pg: Any, *args: Any, **kwargs: Any) -> None:
        seen.update(kwargs, pg=pg)
        raise _Stop

    monkeypatch.setattr(Manager, "__init__", fake_init)
    monkeypatch.setenv(ENV["store"], "127.0.0.1:29400")
    monkeypatch.setenv(ENV["rank"], "2")
    monkeypatch.setenv(ENV["incarnation"], "5")
    return seen


def _construct(**kwargs: Any) -> None:
    with pytest.raises(_Stop):
        ManagerFFT(
            pg=ProcessGroupGloo(),
            min_replica_size=1,
            load_state_dict=None,
            state_dict=None,
            store_addr="127.0.0.1",
            store_port=1,
            rank=0,
            world_size=1,
            **kwargs,
        )


@pytest.mark.timeout(30)
def test_under_fastft_defaults(manager_kwargs: dict[str, Any]) -> None:
    _construct(replica_id="train")
    assert manager_kwargs["replica_id"] == "fastft-2-5/train"
    assert manager_kwargs["hostname"] == "127.0.0.1"  # the job's store is local
    # the bus reports deaths: the lighthouse heartbeat is only a backstop
    assert manager_kwargs["heartbeat_interval"] == timedelta(seconds=1)
    assert type(manager_kwargs["pg"]).__name__ == "_BusProcessGroup"


@pytest.mark.timeout(30)
def test_user_settings_are_kept(manager_kwargs: dict[str, Any]) -> None:
    _construct(
        replica_id="train",
        heartbeat_interval=timedelta(milliseconds=200),
        hostname="node7",
    )
    assert manager_kwargs["heartbeat_interval"] == timedelta(milliseconds=200)
    assert manager_kwargs["hostname"] == "node7"
