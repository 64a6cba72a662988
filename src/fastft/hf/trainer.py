"""fastft under Hugging Face's ``transformers.Trainer``: ``from fastft.hf import Trainer``
in place of ``from transformers import Trainer``, and the script runs under ``fastft run``.

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    trainer.train()

What it does (docs/huggingface.md):

* **The step.** Each optimizer step is a transaction from its first micro-batch's forward
  to the commit: every member draws the whole global batch (the dataloader's batch is
  ``per_device_train_batch_size`` x the world) and computes its part of each micro-batch
  (``tx.shard``); the last micro-batch's gradients are averaged over the members,
  weighted by their shares; ``max_grad_norm`` clips the averaged gradients; and the
  Trainer's ``optimizer.step()`` is the commit, which steps the optimizer on every member
  or on none. A step that rolls back runs again from its first micro-batch (kept with
  their inputs), drawing the same randomness. The loss it reports is the step's, over the
  members (one more small allreduce), so every member's log history is the same.
* **A restart.** The new worker registers and heals once the Trainer built its
  optimizer and scheduler, then goes on from the committed step: the ``TrainerState``
  (global step, log history, best metric, stateful callbacks) comes with the heal, and
  the epoch's first batches are skipped as the Trainer's own resume skips them.
* **Rank 0** saves checkpoints (``save_steps``) and logs; every member evaluates the
  whole evaluation set (the same state and data: the same metrics, no collective).

Not supported (refused at ``train()``, saying what to change): fp16 with a GradScaler,
DeepSpeed and FSDP (the Trainer's own sharding), an ``IterableDataset``."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch.utils.data import IterableDataset
from transformers.trainer_callback import ExportableState

from fastft.process.env import worker_slot
from fastft.runtime.api import Runtime, init
from fastft.runtime.heldstep import HeldStep
from fastft.runtime.transaction import Transaction

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

NOWHERE = os.path.join(os.sep, "nonexistent", "fastft-healed")
"""The Trainer's epoch loop skips a resumed epoch's first batches only when told of a
checkpoint: this one has no files (its RNG state is fastft's, seeded per step)."""

_PER_RANK = ("is_local_process_zero", "is_world_process_zero")
_TIMED = ("_runtime", "_per_second")  # (log entries' timings: this process's clock)
RUNNING = "fastft_running"  # (the Trainer's sums between logs, in the committed state)

LOCAL_RANK = int(os.environ.pop("LOCAL_RANK", "0"))
"""This worker's rank on its node. ``fastft run`` sets torchrun's ``LOCAL_RANK`` for
scripts; Accelerate, seeing it, would start a process group of its own (the Trainer's
DDP) with every worker of the node. Taken out of the environment as this module is
imported (``from fastft.hf import Trainer``, before the script builds its
``TrainingArguments``): each worker is a process of its own to Accelerate."""
os.environ.pop("LOCAL_WORLD_SIZE", None)


class Committed:
    """The ``TrainerState`` as of the last commit, as a registered object: taken as the
    next step begins (after the Trainer's post-commit logging, saving, evaluation), sent
    by a heal, saved by the durable tier, compared by the replica check (the per-rank
    flags left out)."""

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None
        self._log: tuple[list[Any] | None, int, list[str]] = (None, 0, [])
        """The log history's entries taken so far, as JSON: the history grows by a log
        every ``logging_steps`` and is whole in every capture, so each entry is written
        once, and the state carries one string (not a list a step's snapshot copies)."""

    def capture(self, trainer: Trainer) -> None:
        state = trainer.state
        callbacks = [*trainer.callback_handler.callbacks, trainer.control]
        held = {
            f.name: copy.deepcopy(getattr(state, f.name))
            for f in dataclasses.fields(state)
            if f.name not in _PER_RANK and f.name != "log_history"
        }
        held["log_history"] = self._history(state.log_history)
        # the stateful callbacks' states as a checkpoint holds them (the Trainer writes
        # them into its state on the ranks that save only)
        by_name: dict[str, list[Any]] = {}
        for cb in callbacks:
            if isinstance(cb, ExportableState):
                by_name.setdefault(type(cb).__name__, []).append(cb.state())
        held["stateful_callbacks"] = {k: v[0] if len(v) == 1 else v for k, v in by_name.items()}
        # what the Trainer sums between two logs (a worker that joins between them
        # logged a loss over fewer steps, and the flops it had not counted)
        tr_loss = getattr(trainer, "_tr_loss", None)
        held[RUNNING] = {
            "tr_loss": 0.0 if tr_loss is None else float(tr_loss),
            "total_loss_scalar": float(getattr(trainer, "_total_loss_scalar", 0.0)),
            "current_flos": float(trainer.current_flos),
            "globalstep_last_logged": int(getattr(trainer, "_globalstep_last_logged", 0)),
        }
        self.held = held

    def _history(self, log: list[dict[str, Any]]) -> str:
        """``log`` as one JSON string, its entries' timings left out (each process's own
        clock: an evaluation's runtime and throughput)."""
        seen, count, parts = self._log
        if log is not seen or len(log) < count:
            count, parts = 0, []  # (a new history: a resumed worker's, a new run)
        for e in log[count:]:
            parts.append(
                json.dumps({k: v for k, v in e.items() if not k.endswith(_TIMED)}, default=str)
            )
        self._log = (log, len(log), parts)
        return "[" + ",".join(parts) + "]"

    def state_dict(self) -> dict[str, Any]:
        return self.held

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state == self.held:
            return  # (a rollback: what the step began with)
        self.held = dict(state)
        self.loaded = self.held


class _Commit:
    """The Trainer's optimizer: its ``step()`` is the transaction's commit (everything
    else is the optimizer's own)."""

    def __init__(self, trainer: Trainer, inner: Any) -> None:
        self._trainer = trainer
        self._inner = inner

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._trainer.commit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` under ``fastft run`` (see the module's docstring).
    ``fastft_init``: keyword arguments for :func:`fastft.init`."""

    def __init__(
        self, *args: Any, fastft_init: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self._fastft_init = dict(fastft_init or {})
        self.slot = worker_slot()  # (rank, world); a clear ConfigError outside fastft run
        super().__init__(*args, **kwargs)
        _members_args(self.args, lambda: self.slot[0] == 0)
        self._train_batch_size *= self.slot[1]  # (the global batch every member draws)
        self.ft: Runtime | None = None
        self.held = HeldStep()
        """The step's transaction, open across its micro-batches."""
        self.committed = Committed()
        self._kept: list[tuple[Any, Any, Any]] = []
        """The step's micro-batches so far: (model, inputs, num_items_in_batch)."""
        self._attempt: list[torch.Tensor] = []  # (this attempt's losses, by share)
        self._epoch_sizes: tuple[int, int] | None = None  # (updates per epoch, accumulation)
        self._resume: tuple[int, int] | None = None
        self._running: dict[str, Any] | None = None

    @property
    def tx(self) -> Transaction | None:
        return self.held.tx

    # --- who logs and saves -----------------------------------------------------------------
    def is_world_process_zero(self) -> bool:
        return self.slot[0] == 0

    def is_local_process_zero(self) -> bool:
        return LOCAL_RANK == 0

    # --- joining the job --------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        if self.args.fp16:
            raise ValueError(
                "fastft.hf.Trainer: fp16 steps the optimizer through a GradScaler, outside "
                "fastft's commit; use bf16=True or full precision"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "fastft.hf.Trainer: DeepSpeed and FSDP shard the model themselves; fastft "
                "replicates it (shard groups: fastft run --shard-size, docs/hsdp.md)"
            )
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "fastft.hf.Trainer: an IterableDataset has no place a restarted worker can "
                "resume at; use a map-style dataset (or fastft.Batches in a plain loop)"
            )
        out = super().train(*args, **kwargs)
        ft, self.ft = self.ft, None
        if ft is not None:
            ft.close()
        return out

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        values = super().set_initial_training_values(args, dataloader)
        self._epoch_sizes = (int(values[1]), int(args.gradient_accumulation_steps))
        return values

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume: Any) -> Any:
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume)
        self.ft = ft = init(**self._fastft_init)  # (a spare that ran ahead: its order here)
        self.slot = (ft.config.rank, ft.config.world_size)
        self.state.is_world_process_zero = self.is_world_process_zero()
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # (accelerate's wrapper)
        self.committed.capture(self)
        ft.register(
            model=self.model,
            optimizer=inner,
            lr_scheduler=self.lr_scheduler,
            trainer_state=self.committed,
        )
        self.optimizer = _Commit(self, self.optimizer)  # type: ignore[assignment]
        got, self.committed.loaded = self.committed.loaded, None
        if got and got.get("global_step"):
            self._resume_at(got)
        return model, train_dataloader

    def _resume_at(self, got: dict[str, Any]) -> None:
        """The healed (or restored) ``TrainerState``: this worker's loop goes on after its
        global step, as the Trainer's own resume from a checkpoint does."""
        self._running = got.get(RUNNING)
        for k, v in got.items():
            if k != RUNNING:
                setattr(self.state, k, json.loads(v) if k == "log_history" else v)
        self._load_callback_state()  # (the stateful callbacks: early stopping's patience)
        assert self._epoch_sizes is not None
        per_epoch, accumulation = self._epoch_sizes
        step = self.state.global_step
        self._resume = (step // per_epoch, (step % per_epoch) * accumulation)
        log.info("fastft: the Trainer resumes at step %d (epoch %d)", step, self._resume[0])

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if self._resume is not None:
            epoch, skip = self._resume
            if kwargs["epoch"] < epoch:
                return None  # (an epoch the job had trained before this worker joined)
            self._resume = None
            self._initial_global_step = self.state.global_step
            if (running := self._running) is not None:  # (the loop reset them as it began)
                self._tr_loss = torch.tensor(running["tr_loss"], device=self.args.device)
                self._total_loss_scalar = running["total_loss_scalar"]
                self.current_flos = running["current_flos"]
                self._globalstep_last_logged = running["globalstep_last_logged"]
            kwargs.update(resume_from_checkpoint=NOWHERE, epochs_trained=epoch)
            kwargs.update(steps_trained_in_current_epoch=skip)
            self._save_due(kwargs["model"], kwargs.get("trial"))
        return super()._run_epoch(*args, **kwargs)

    def _save_due(self, model: Any, trial: Any) -> None:
        """A checkpoint due at the step this worker resumed at: its last life (or the
        peer it healed from, rank 0's) saved it after the commit, or died first; rank 0
        saves it now, with exactly the committed state (else a fault between a commit and
        its save left the checkpoint out)."""
        args = self.args
        every = int(args.save_steps) if args.save_steps and args.save_steps >= 1 else 0
        if args.save_strategy != "steps" or not every or self.state.global_step % every:
            return
        if args.should_save:
            self._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir: str) -> None:
        if self.args.should_save:  # (the Trainer's own writes it on every process it knows)
            super()._save_rng_state(output_dir)

    # --- the step ---------------------------------------------------------------------------
    def training_step(
        self, model: Any, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One micro-batch of the step's transaction: the first opens it (after a rollback
        the step's earlier micro-batches run again first); the last averages the
        gradients and returns the step's loss over the members (the others return 0: the
        Trainer's running loss, which it logs, grows by the same on every member)."""
        last = bool(self.accelerator.sync_gradients)
        while True:
            try:
                if self.tx is None:
                    self._begin()
                else:
                    self.held.resume()
                loss = self._micro(model, inputs, num_items_in_batch)
                self._kept.append((model, inputs, num_items_in_batch))
                if not last:
                    self.held.pause()
                    return torch.zeros_like(loss)  # (the step's loss comes with its last)
                return torch.tensor(self._reduce(), dtype=loss.dtype, device=loss.device)
            except BaseException as e:
                if self._kept and self._kept[-1][1] is inputs:
                    self._kept.pop()  # (it runs again as this call's, not as a kept one)
                if self.held.close(e):
                    continue  # rolled back: the step again
                raise

    def commit(self) -> None:
        """The Trainer's ``optimizer.step()``: the transaction commits (the optimizer
        steps on every member or on none); if it rolls back, the step runs again here,
        its micro-batches, reduction and clipping, until it commits."""
        while True:
            try:
                if self.tx is None:
                    self._begin()
                    self._reduce()
                    if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                        self._clip_grad_norm(self._kept[-1][0])
                if self.held.close(None):
                    self._kept = []
                    return
            except BaseException as e:
                if self.held.close(e):
                    continue
                raise

    def _micro(self, model: Any, inputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        """This member's part of a micro-batch: its loss the mean over the part (the
        gradients' average weights each member's by its share, as the loss here)."""
        assert self.tx is not None
        part, share = _part(inputs, self.tx)
        loss = super().training_step(model, part, None)
        self._attempt.append(loss.detach().double() * share)
        return loss

    def _reduce(self) -> float:
        """Average the step's gradients over the members, and sum its weighted losses:
        the step's loss over the whole global batch."""
        assert self.tx is not None
        self.tx.allreduce_gradients()
        total = torch.stack(self._attempt).sum().reshape(1)
        self.tx.allreduce([total])
        return float(total)

    def _begin(self) -> None:
        assert self.ft is not None
        # (the state after the last commit's logging, saving and evaluation: what a heal
        # sends, inside the transaction's start)
        self.committed.capture(self)
        self._attempt = []
        tx = self.held.open(self.ft)
        if tx.step != self.state.global_step:
            raise RuntimeError(
                f"fastft: this worker's Trainer is at step {self.state.global_step}, the "
                f"job's committed state at step {tx.step} (a heal while it was behind): it "
                "ends, and comes back as a restarted worker"
            )
        for kept in self._kept:  # (after a rollback: the step's micro-batches so far)
            self._micro(*kept)


def _part(inputs: Any, tx: Transaction) -> tuple[dict[str, Any], float]:
    """This member's rows of each tensor of the micro-batch (the batch dimension first),
    and its share of them."""
    if not isinstance(inputs, dict | transformers.BatchEncoding):
        raise TypeError(
            f"fastft.hf.Trainer: a micro-batch of {type(inputs).__name__}; the Trainer's "
            "data collators give a dict of tensors"
        )
    sizes = {v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1:
        raise ValueError(
            f"fastft.hf.Trainer: the micro-batch's tensors disagree on the batch size: {sizes}"
        )
    n = sizes.pop()
    mine = tx.shard(n)
    part = {k: v[mine] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()}
    return part, (mine.stop - mine.start) / n


def _members_args(args: Any, zero: Callable[[], bool]) -> None:
    """Rank 0 alone (``zero()``) saves and logs (the Trainer asks its ``TrainingArguments``,
    which read Accelerate's process index: 0 in every worker, each a process of its own
    to it)."""
    cls = type(args)

    def reduce_ex(self: Any, protocol: Any) -> Any:  # (pickled as the script's own class)
        return (object.__new__, (cls,), dict(self.__dict__))

    members = type(
        cls.__name__,
        (cls,),
        {
            "should_save": property(lambda self: zero()),
            "should_log": property(lambda self: zero()),
            "__reduce_ex__": reduce_ex,
            "__module__": cls.__module__,
        },
    )
    args.__class__ = members
