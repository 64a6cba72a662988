"""The data plane as the step engine, the heal and the step see it: a contract, so that
the engine can be built over a fake (:class:`fastft.testing.engine.FakePlane`).
:class:`~fastft.runtime.groups.dataplane.DataPlane` is the real one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from fastft.runtime.contract import EpochView
    from fastft.runtime.groups.dataplane import HealTail
    from fastft.runtime.groups.hsdp import StepGate

__all__ = ["Plane"]


class Plane(Protocol):
    @property
    def k(self) -> int:
        """Workers per shard group (1: none)."""

    @property
    def gate(self) -> StepGate | None:
        """Shard groups: the gate a group's members cross together into each step."""

    @property
    def pg(self) -> Any:
        """The epoch's process group (None when there is none: not built, or aborted)."""

    @property
    def pg_epoch(self) -> int: ...

    @property
    def heal_pg(self) -> tuple[int, Any] | None:
        """(epoch, group) of the source and the members it heals."""

    @property
    def heal_tail(self) -> HealTail | None:
        """The optimizer state of this epoch's heal, still in transit."""

    def backend(self) -> str: ...

    def gpu(self) -> torch.device | None: ...

    def comm_device(self) -> torch.device: ...

    def heal_apart(self) -> bool: ...

    def group_ranks(self, view: EpochView, rank: int) -> list[int]: ...

    def abort(self, epoch: int) -> None: ...

    def release_heal(self, *, pending: bool) -> None: ...

    def configure(
        self, view: EpochView, rank: int, prefix: str, cancelled: Callable[[], bool]
    ) -> bool: ...

    def set_gate(self, gate: StepGate) -> None: ...

    def hold_tail(self, tail: HealTail) -> bool: ...

    def drop_tail(self, tail: HealTail) -> bool: ...
