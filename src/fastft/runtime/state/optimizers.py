"""Several optimizers registered as one (issue 61): a GAN's generator and discriminator,
an encoder and a head at their own settings.

``ft.register(model=nets, optimizer=[opt_g, opt_d])`` (or ``fastft.Optimizers(opt_g,
opt_d)``) gives fastft one optimizer whose parameter groups are the given optimizers'
groups in order and whose state is theirs (keyed by parameter: each optimizer's own):
a commit steps every one, a rollback puts every group's settings
back, a heal, a checkpoint and the replica check carry all of them in torch's own
``state_dict`` format, and ``register`` refuses a scheduler of any of them left out. Each
optimizer stays the script's: its schedulers step it as before.

Register the nets as one module (``nn.ModuleDict({"g": g, "d": d})``): the gradients and
the buffers of every one are then reduced as a single model's are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Optimizers"]


class Optimizers(torch.optim.Optimizer):
    """``optimizers`` stepped, saved and restored as one (see the module)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("fastft.Optimizers takes one or more torch.optim.Optimizer")
        if any(isinstance(o, Optimizers) for o in optimizers):
            raise TypeError("fastft.Optimizers: pass the optimizers themselves, not a group")
        params = [id(p) for o in optimizers for g in o.param_groups for p in g["params"]]
        if len(params) != len(set(params)):
            raise TypeError("fastft.Optimizers: a parameter is in two of the optimizers")
        self.optimizers = list(optimizers)
        self.defaults: dict[str, Any] = {}
        self._share()

    def _share(self) -> None:
        """Every optimizer's groups in order, as this optimizer's own."""
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:  # type: ignore[override]
        """Every optimizer's state by parameter (a merged view: their keys, parameters,
        never collide; each optimizer keeps its own dict, which its own ``state_dict``
        reads)."""
        return defaultdict(dict, ((p, st) for o in self.optimizers for p, st in o.state.items()))

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise TypeError("fastft.Optimizers.step takes no closure")
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("fastft.Optimizers: add the group to one of its optimizers")

    def state_dict(self) -> dict[str, Any]:
        """torch's format over every optimizer's groups, in order."""
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
        by_id = {id(p): p for g in self.param_groups for p in g["params"]}
        state = {index[i]: self.state[p] for i, p in by_id.items() if p in self.state}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, state = state_dict["param_groups"], state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"fastft.Optimizers: a state of {len(groups)} parameter groups for "
                f"{len(self.param_groups)}"
            )
        at = 0
        for o in self.optimizers:
            mine = groups[at : at + len(o.param_groups)]
            at += len(o.param_groups)
            olds = _ordered(i for g in mine for i in g["params"])
            new = {old: n for n, old in enumerate(olds)}
            o.load_state_dict(
                {
                    "state": {new[i]: state[i] for i in olds if i in state},
                    "param_groups": [{**g, "params": [new[i] for i in g["params"]]} for g in mine],
                }
            )
        self._share()  # (each load made the optimizer new groups)

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(type(o).__name__ for o in self.optimizers)})"

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizers": self.optimizers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optimizers = state["optimizers"]
        self.defaults = {}
        self._share()


def _ordered(ids: Iterable[int]) -> list[int]:
    seen: dict[int, None] = {}
    for i in ids:
        seen.setdefault(i, None)
    return list(seen)
