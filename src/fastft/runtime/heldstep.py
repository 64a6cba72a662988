"""A transaction held open across a framework's calls: the training loops fastft plugs
into (Lightning's strategy, Hugging Face's Trainer) hand it a step's micro-batches one call
at a time, with their own code between two of them, so the ``with ft.transaction()``
block a hand-written loop has cannot enclose the step. :class:`HeldStep` opens the
transaction at the step's first micro-batch, shields the framework's code between two
micro-batches from a peer's interrupt (it comes at the next micro-batch instead), and
leaves it at the commit, or on an exception, saying whether the step is done."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastft.runtime.api import Runtime
    from fastft.runtime.transaction import Transaction

__all__ = ["HeldStep"]


class HeldStep:
    """The step's transaction while it is open (``tx``; None between steps)."""

    def __init__(self) -> None:
        self.tx: Transaction | None = None
        self._ft: Runtime | None = None
        self._shield: Any = None

    def open(self, ft: Runtime) -> Transaction:
        """Begin the step's transaction (a formation, a heal, a rollback's end first)."""
        self._ft = ft
        tx = ft.transaction()
        tx.__enter__()  # noqa: PLC2801 - held open across the step's micro-batches
        self.tx = tx
        return tx

    def close(self, exc: BaseException | None) -> bool:
        """Leave the transaction: True if it committed (``exc`` None) or rolled back on
        ``exc`` (a peer's fault: the step runs again); False if ``exc`` is the worker's
        to raise, or no transaction was open, or the commit did not happen."""
        tx, self.tx = self.tx, None
        if self._shield is not None:  # (an exception of the framework's between two)
            shield, self._shield = self._shield, None
            with contextlib.suppress(BaseException):
                shield.__exit__(None, None, None)
        if tx is None:
            return False
        if exc is None:
            tx.__exit__(None, None, None)
            return tx.committed
        return bool(tx.__exit__(type(exc), exc, exc.__traceback__))

    def pause(self) -> None:
        """The framework's own code runs until the next micro-batch: a peer's fault that
        comes meanwhile is raised at :meth:`resume`, not torn into that code."""
        assert self._ft is not None
        self._shield = self._ft.interrupter.atomic()
        self._shield.__enter__()  # noqa: PLC2801

    def resume(self) -> None:
        """The next micro-batch: raises the interrupt that came meanwhile, if any."""
        shield, self._shield = self._shield, None
        if shield is not None:
            shield.__exit__(None, None, None)
