"""fastft: fast fault tolerance for distributed training.

``import fastft`` is cheap (torch is imported on first use)::

    ft = fastft.init()
    ft.register(model=model, optimizer=opt)
    while ft.step < total_steps:
        with ft.transaction() as tx:
            ...
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

# torchdata's StatefulDataLoader calls torch.set_vital, which torch deprecated: a warning at
# each loader's construction, in every worker life, that no script can act on (issue 53)
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

if TYPE_CHECKING:
    from fastft.runtime import Batches, Optimizers, Runtime, RuntimeConfig, Transaction, init

__all__ = ["init", "Batches", "Optimizers", "Runtime", "RuntimeConfig", "Transaction"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fastft import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'fastft' has no attribute {name!r}")
