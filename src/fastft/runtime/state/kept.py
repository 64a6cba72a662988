"""Kept gradients (elastic worlds): each member keeps a copy of its weighted local
gradient before the step's allreduce, so that when the world shrinks in that step the
retry computes only the samples no survivor kept (:mod:`fastft.protocol.shards`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fastft.protocol.shards import plan as plan_shards
from fastft.protocol.shards import tile
from fastft.runtime.contract import EpochView

if TYPE_CHECKING:
    from fastft.runtime.state.registry import StateRegistry

__all__ = ["KeptGradients", "commit_fields"]


class KeptGradients:
    """The share of the step's batch this member took, and the gradient it kept."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.kept: tuple[int, int, int, int] | None = None
        """(step, lo, hi, n) of the weighted local gradient in ``grad``."""
        self.grad: torch.Tensor | None = None
        self.share: tuple[int, int, int] | None = None
        """(lo, hi, n): the slice of the global batch this member took in this step."""
        self.adding: tuple[int, int] | None = None
        """The kept range this attempt adds to its own part."""
        self._taken_now = False
        self._faulted = False
        self._reduced = 0
        """Weighed reductions in this attempt: the first is the gradient (kept)."""
        self._fresh = 0
        """Samples of the step computed in this attempt (the batch less the kept parts)."""

    def begin_attempt(self) -> None:
        self.share = None
        self.adding = None
        self._faulted = False
        self._taken_now = False
        self._reduced = 0

    def fault(self) -> None:
        """This attempt raised: nothing it computed is offered as kept (an exception may
        mean a bad gradient); a part kept by an earlier attempt of the step stays valid."""
        self._faulted = True
        if self._taken_now:
            self.kept, self._taken_now = None, False

    def of_step(self, step: int) -> tuple[int, int, int] | None:
        """(lo, hi, n) kept of ``step``: offered when the next epoch forms."""
        return self.kept[1:] if self.kept is not None and self.kept[0] == step else None

    def shard(self, view: EpochView | None, step: int, n: int, world: int, index: int) -> slice:
        """This member's part of ``step``'s batch of ``n``; see ``Transaction.shard``."""
        mine: tuple[int, int] | None = None
        if view is not None and view.kept and view.step == step:
            ranks = view.ranks
            offered = {view.index(r): (lo, hi, m) for r, lo, hi, m in view.kept if r in ranks}
            p = plan_shards(n, world, offered)
            lo, hi = p.pieces[index]
            mine = p.kept.get(index)
            self._fresh = n - sum(b - a for a, b in p.kept.values())
            if mine is not None and self.kept != (step, *mine, n):  # pragma: no cover
                raise AssertionError(f"kept gradient {self.kept} is not the offered {mine}")
        elif n < world:
            raise ValueError(f"a global batch of {n} samples cannot feed {world} members")
        else:
            lo, hi = tile(0, n, world, index)
            self._fresh = n
        self.share = (lo, hi, n)
        self.adding = mine
        return slice(lo, hi)

    def worth_finishing(self) -> bool:
        """Whether this attempt's own part will be kept (a peer's fault is then deferred
        until the part is done)."""
        return self.enabled and self.adding is None

    def weigh(self, flat: torch.Tensor, step: int) -> None:
        """Before the allreduce: weigh the local gradient by the share, then add the kept
        part this attempt reuses, or keep a copy the allreduce cannot touch (taken before
        the interrupt check: a peer's fault during this member's own part was deferred to
        here, the part is done). The attempt's first weighed reduction is its gradient; a
        later one (a ``tx.pmean`` of a metric) is weighed by this member's share of the
        samples the attempt computed (kept parts are not computed again), nothing kept."""
        if self.share is None:
            return
        lo, hi, n = self.share
        self._reduced += 1
        if self._reduced > 1:  # (a later reduction, a metric: the samples computed now)
            flat.mul_((hi - lo) / self._fresh)
            return
        flat.mul_((hi - lo) / n)
        if self.adding is not None:
            assert self.grad is not None
            flat.add_(self.grad)
        elif self.enabled and not self._faulted:
            kg = self.grad
            if kg is None or (kg.shape, kg.dtype, kg.device) != (
                flat.shape,
                flat.dtype,
                flat.device,
            ):
                self.grad = kg = torch.empty_like(flat)
            kg.copy_(flat)
            self.kept, self._taken_now = (step, lo, hi, n), True


def commit_fields(
    registry: StateRegistry, kept: KeptGradients, check_every: int, step: int
) -> dict[str, Any]:
    """A commit event's record of the state: the digest every ``check_every`` commits (S3,
    offline), the share of the global batch this member trained on, the kept part it
    added, and DiLoCo's anchor digest."""
    due = check_every and (step + 1) % check_every == 0
    digest = registry.digest(step + 1) if due else None
    share = list(kept.share) if kept.share is not None else None
    out: dict[str, Any] = {"digest": digest, "shard": share}
    if kept.adding is not None and share is not None:
        out["kept"] = [*kept.adding, share[2]]
    if digest is not None and registry.outer is not None:
        out["outer"] = registry.outer_digest()  # (--sync diloco: S3 of the anchor)
    return out
