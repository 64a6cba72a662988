"""Shard groups and replicate groups (HSDP): who reduces with whom, who heals whom.

With ``--shard-size K`` the ranks ``g*K .. g*K+K-1`` form shard group ``g``: they shard one
copy of the model among themselves with FSDP2 (:meth:`fastft.Runtime.shard_mesh` gives
the mesh), and shard index ``i = rank % K`` holds the same part of the model in every
group. The groups are data-parallel peers:

- **Reduce.** FSDP2 reduce-scatters the gradients inside a group during backward; the
  transaction then averages each shard over the members of the same index in every group
  (the epoch's *replicate group*), interruptibly, and commits or rolls back per
  (epoch, step) as for one worker per replica.
- **Unit of fault.** A member's death, hang or exception takes its whole group down (the
  agent restarts it as a whole, :func:`fastft.launch.rules.policy.group_mates`): FSDP's
  collectives inside a group cannot go on without a member, and Gloo cannot abort them.
- **Heal.** A restarted member fetches its shard from the lowest live member of the same
  index, and every index heals at once in a group of its own: K heals of 1/K of the state
  each, in parallel.

Pure functions over an :class:`EpochView`; the executors call them.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Set
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fastft.runtime.contract import EpochView, Member, RuntimeConfig

__all__ = [
    "heal_group",
    "is_sharded",
    "load_model_shards",
    "local",
    "meet_shard_group",
    "optimizer_shards",
    "replicate_ranks",
    "shard_source",
    "StepGate",
    "broken_groups",
    "whole_groups",
]


def replicate_ranks(view: EpochView, rank: int, k: int) -> list[int]:
    """The members of ``view`` with ``rank``'s shard index (all members when ``k`` is 1),
    in rank order: the group its gradients are averaged over."""
    return [m.rank for m in view.members if m.rank % k == rank % k]


def shard_source(view: EpochView, rank: int, k: int) -> int | None:
    """Who sends ``rank``'s shard in ``view``: the epoch's source when ``k`` is 1; else
    the lowest member of the same index that holds the committed state, or, at a start
    from step 0 where only the source holds it, the lowest member of the index (every
    member built its shard from the same seed)."""
    if view.source is None or k == 1:
        return view.source
    same = replicate_ranks(view, rank, k)
    holders = [r for r in same if r not in view.needs_state]
    return holders[0] if holders else same[0]


def heal_group(view: EpochView, rank: int, k: int) -> list[int] | None:
    """The heal group of ``rank``'s shard index in ``view`` (its source first), when
    ``rank`` is in one: the source and the members of the index that need state."""
    src = shard_source(view, rank, k)
    if src is None or not view.needs_state:
        return None
    needs = sorted(r for r in view.needs_state if r % k == rank % k and r != src)
    if not needs:
        return None
    ranks = [src, *needs]
    return ranks if rank in ranks else None


def broken_groups(view: EpochView, dead: Set[Member], k: int) -> set[int]:
    """The shard groups of ``view`` with a member known dead: their agent takes the rest of
    them down too, so none of them is waited for or admitted as a survivor."""
    if k == 1:
        return set()
    return {m.rank // k for m in view.members if m in dead}


def whole_groups(ranks: Iterable[int], k: int) -> set[int]:
    """Those of ``ranks`` whose shard group is all there: an epoch admits whole groups."""
    have = set(ranks)
    return {r for r in have if all(q in have for q in range(r - r % k, r - r % k + k))}


def meet_shard_group(config: RuntimeConfig, store: dist.Store, device_type: str | None) -> Any:
    """Make this worker's shard group torch's default process group, and return its 1-D
    ``DeviceMesh`` for ``fully_shard``. The members meet under the generation the agent
    started the group with (``group_gen``); the group lives as long as they do."""
    from torch.distributed.device_mesh import DeviceMesh

    k = config.shard_size
    prefix = f"fastft/{config.job}/shard-group/{config.rank // k}/{config.group_gen}/"
    backend = config.backend
    if backend == "auto":
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store.clone()),  # type: ignore[attr-defined]
        rank=config.rank % k,
        world_size=k,
        timeout=datetime.timedelta(seconds=config.pg_timeout_s),
    )
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return DeviceMesh(device, list(range(k)))


class StepGate:
    """The members of a shard group run a step's body together or not at all.

    FSDP's collectives inside the body pair up by order on the group's process group, and
    Gloo cannot abandon one: a member that started a step's forward while its group mate,
    told of a fault a moment earlier, went to roll back without it, waited in the
    all-gather until it was killed as hung (and its group with it). So every member
    crosses the gate of every attempt (epoch, step) exactly once: on entering it (``go``:
    it knows of no fault) or on rolling it back without having entered (``go`` False).
    The gate is a MIN over the group: the body runs only if every member said go."""

    def __init__(self, blocked: Any) -> None:
        self._blocked = blocked  # (the heartbeat goes on while a group mate is awaited)
        self.crossed: tuple[int, int] | None = None

    def cross(self, attempt: tuple[int, int], go: bool) -> bool:
        flag = torch.tensor([1 if go else 0], dtype=torch.int32)
        with self._blocked:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        self.crossed = attempt
        return bool(flag.item())

    def leave(self, attempt: tuple[int, int]) -> None:
        """``attempt`` rolls back: cross its gate (as a no) unless this member entered it."""
        if self.crossed != attempt:
            self.cross(attempt, go=False)


# --- sharded state (FSDP2's DTensors) as the heal, the digest and the reduce see it --------
def is_sharded(model: nn.Module | None) -> bool:
    """Whether ``model``'s parameters are DTensors (``fully_shard``)."""
    return model is not None and any(isinstance(p, DTensor) for p in model.parameters())


def local(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by this member's shard of it: a heal sends, and
    a digest hashes, what this member holds (equal on the members of one shard index)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(local(v) for v in obj)
    return obj


def load_model_shards(model: nn.Module, received: dict[str, Any]) -> None:
    """Copy the shards a heal received into ``model``'s own (FSDP2 keeps its parameters;
    replacing them would detach them from its parameter groups)."""
    own = model.state_dict()
    if set(own) != set(received):
        raise ValueError(
            f"heal: the shards received name {sorted(set(received) ^ set(own))[:4]} that "
            "this model does not (or the other way round): every group must build the same "
            "model and shard it the same way"
        )
    with torch.no_grad():
        for name, mine in own.items():
            target = mine.to_local() if isinstance(mine, DTensor) else mine
            target.copy_(received[name])


def optimizer_shards(optimizer: torch.optim.Optimizer, received: dict[str, Any]) -> dict[str, Any]:
    """A received optimizer state (shards as plain tensors) made loadable: every tensor of
    a sharded parameter's state that has the shape of this member's shard becomes a
    DTensor laid out as the parameter."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[Any, Any] = {}
    for idx, entry in received["state"].items():
        p = params[int(idx)]
        if not isinstance(p, DTensor):
            state[idx] = entry
            continue
        shard = p.to_local().shape
        state[idx] = {
            key: DTensor.from_local(
                v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == shard
            else v
            for key, v in entry.items()
        }
    return {**received, "state": state}
