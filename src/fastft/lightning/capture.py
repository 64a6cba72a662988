"""The strategy's callback (:class:`Capture`): the Trainer's committed state taken after
each batch whose step committed, and a resumed worker's checkpoint due at its last
commit (:mod:`fastft.lightning.strategy`)."""

from __future__ import annotations

import signal
import threading
from typing import Any, Protocol

from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.trainer.states import TrainerFn

from fastft.lightning.resume import LoopState
from fastft.runtime.transaction import Transaction

__all__ = ["Capture", "Committed"]


class Committed(Protocol):
    """What the callback reads and clears of the strategy
    (:class:`~fastft.lightning.strategy.FastFTStrategy` is one)."""

    committed: bool
    resumed: bool
    loops: LoopState
    sigterm: Any

    @property
    def tx(self) -> Transaction | None: ...


class Capture(Callback):
    """Takes the Trainer's committed state after each batch whose step committed: last
    in the callbacks (a ModelCheckpoint's state after its save is in it)."""

    def __init__(self, strategy: Committed) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.strategy.committed:
            self.strategy.committed = False
            self.strategy.loops.capture(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """An evaluation after a committed step changed the callbacks (EarlyStopping's
        best score, a monitored ModelCheckpoint's): taken again, as Lightning's own
        checkpoint at a validation's end (a worker resumed from it skips that evaluation,
        so it must hold what the evaluation did). One between two micro-batches of a step
        is not taken: a worker resumed at the last commit runs it again."""
        if self.strategy.tx is None and trainer.state.fn == TrainerFn.FITTING:
            self.strategy.loops.capture(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A resumed worker's loop begins after the batch of the last commit, whose end
        its last life (or the peer it healed from) ran, and this one did not: a
        ModelCheckpoint due at that step saves now, the state exactly the committed one
        (else the restarted rank 0 saved it a micro-batch later, or never)."""
        sigterm = self.strategy.sigterm
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            # Lightning's own handler (installed as fit began) ends fit with a status of 0
            # after the batch: under fastft a SIGTERM is a drain at the next commit, and
            # the job then ends with 143, resumable (fastft's handler, which it replaced)
            signal.signal(signal.SIGTERM, sigterm)
        if not self.strategy.resumed:
            return
        self.strategy.resumed = False
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint):
                cb.on_train_batch_end(trainer, pl_module, None, None, batch_idx)
