"""A registered model's plain Python attributes, as registered state (issue 61).

A script keeps state on its model's own modules: a counter its loss reads (a warmup of
label smoothing), a temperature, the steps seen. Not a parameter nor a buffer, it was in no
snapshot, heal, checkpoint or digest: a rolled-back step left it advanced, a restarted rank
started it from zero, and the ranks ended at 41/28/41 of 40 with parameters 2.5e-2 from the
fault-free run. :func:`module_attributes` finds such attributes at ``ft.register`` (the
numbers, ints, floats and bools and tuples or lists of them, of the modules whose classes
are the script's: torch's own modules hold their settings there, which no step changes;
not one whose name says it is the process's own, its rank or device), and :class:`ModuleAttributes` carries them as one more registered object: rolled
back with a step, sent in a heal, saved in a checkpoint, compared by the replica check. An
attribute added after ``register`` is not seen; register it (or set it in ``__init__``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ModuleAttributes", "module_attributes"]

_PLAIN = (int, float, bool)
_PER_PROCESS = ("rank", "world", "device", "gpu", "local", "pid", "host")
"""An attribute whose name says it is the process's own (its rank, its device) is not the
job's state: a heal would copy a peer's, and the replica check would call it a
divergence."""


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, tuple | list) and len(value) <= 64 and all(map(_plain, value))


def _own(module: nn.Module) -> bool:
    """Whether ``module``'s class is the script's (not torch's, whose attributes are its
    settings)."""
    return not type(module).__module__.startswith(("torch.", "torchvision.", "transformers."))


def module_attributes(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """The plain attributes of ``model``'s own modules: ``"path.name" -> (module, name)``."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for path, m in model.named_modules():
        if not _own(m):
            continue
        for name, value in vars(m).items():
            if name.startswith("_") or name == "training" or not _plain(value):
                continue
            if any(word in name.lower() for word in _PER_PROCESS):
                continue
            out[f"{path}.{name}" if path else name] = (m, name)
    return out


class ModuleAttributes:
    """The attributes :func:`module_attributes` found, as a registered object."""

    def __init__(self, found: dict[str, tuple[nn.Module, str]]) -> None:
        self.found = found

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(m, name) for key, (m, name) in self.found.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            where = self.found.get(key)
            if where is None:
                continue
            if isinstance(value, list) and isinstance(getattr(*where, None), tuple):
                value = tuple(value)  # (a heal's header is JSON: a tuple arrives a list)
            setattr(where[0], where[1], value)
