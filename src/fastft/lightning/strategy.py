"""fastft under PyTorch Lightning: a ``Strategy`` for ``Trainer`` with which an unchanged
``LightningModule`` trains under ``fastft run``, each optimizer step a transaction.

    trainer = Trainer(strategy=FastFTStrategy(), max_steps=..., ...)  # the one line
    trainer.fit(model, datamodule)

What it does (docs/lightning.md):

* **The step.** Lightning's closure (``training_step``, ``zero_grad``, ``backward``) runs
  inside ``ft.transaction()``; the gradients are averaged over the members there
  (interruptible), then Lightning's ``on_before_optimizer_step`` hooks and its gradient
  clipping run on the averaged gradients, and the commit steps the optimizer on every
  member or on none. A step that rolls back runs again at once, with the same batch; with
  ``accumulate_grad_batches=k`` the transaction spans the step's ``k`` micro-batches
  (``handles_gradient_accumulation``: the strategy accumulates) and a retry runs them all
  again, drawing the same randomness (fastft seeds it as the step begins).
* **A restart.** The new worker registers and heals in ``setup``, then the state the heal
  brought (:class:`~fastft.lightning.resume.LoopState`) is restored as Lightning's resume
  from a checkpoint (``fit(ckpt_path=...)``) restores it: the loops at the batch after the
  last commit, the callbacks, the datamodule, the train loader's place.
* **Collectives.** Only a step's reductions are the members' (``self.log(...,
  sync_dist=True)`` in ``training_step``); evaluation runs on every member over the whole
  validation set (the same state, the same data: the same metrics, no collective that a
  fault could leave hanging), so a reduction or a broadcast outside a step returns this
  member's value, which is every member's.

Not supported (each refused at ``fit`` with what to change): manual optimization,
``16-mixed`` precision (its GradScaler steps the optimizer itself), a train loader that
cannot be resumed (an ``IterableDataset``: use ``fastft.Batches`` in a plain loop)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any, cast

import torch
from lightning_fabric.plugins.environments import LightningEnvironment
from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import RunningStage, TrainerFn

from fastft.lightning.capture import Capture
from fastft.lightning.resume import LoopState, resumable, why_not
from fastft.process.env import worker_slot
from fastft.runtime.api import Runtime, init
from fastft.runtime.heldstep import HeldStep
from fastft.runtime.transaction import Transaction

__all__ = ["FastFTStrategy"]

log = logging.getLogger(__name__)


class FastFTStrategy(ParallelStrategy):
    """Train a ``LightningModule`` under ``fastft run``: ``Trainer(strategy=
    FastFTStrategy())``. ``init``: keyword arguments for :func:`fastft.init`
    (``compare_every=...``, ``seed=...``). One process per worker, one device each (the
    CPU, or the GPU of the worker's local rank)."""

    strategy_name = "fastft"

    def __init__(self, **init: Any) -> None:
        super().__init__()
        self._init = init
        self.slot = worker_slot()  # (rank, world); a clear ConfigError outside fastft run
        self.ft: Runtime | None = None
        self.held = HeldStep()
        """The step's transaction, open across its micro-batches."""
        self.loops = LoopState()
        self.committed = False
        """A step committed in the batch running (its end captures the loops)."""
        self._kept: list[Callable[[], Any]] = []
        """The closures of the step's micro-batches so far (a retry runs them again)."""
        self.stepping: Transaction | None = None
        """The transaction whose closure runs (its collectives are the members')."""
        self._failed = False
        self.sigterm: Any = None
        self._held_buffers: list[torch.Tensor] | None = None
        self.resumed = False
        """This worker resumed from a heal or a restore (its first batch end is not the
        committed step's)."""

    @property
    def tx(self) -> Transaction | None:
        return self.held.tx

    # --- where this worker is -------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
        return devices[0]

    @property
    def global_rank(self) -> int:
        return self.slot[0]

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))  # (fastft run sets torchrun's names)

    @property
    def node_rank(self) -> int:
        return self.global_rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    @property
    def world_size(self) -> int:
        return self.slot[1]

    @property
    def is_distributed(self) -> bool:
        return True  # (Lightning gives the train loader a DistributedSampler)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The train loader's shard is this worker's slot's; every other loader is whole
        on every member (an evaluation without collectives)."""
        model = self._lightning_module
        trainer = model.trainer if model is not None else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": 1, "rank": 0}

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # (every micro-batch reaches optimizer_step: a retry runs them again)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup_environment(self) -> None:
        self.setup_environment_ranks()
        super().setup_environment()

    def setup_environment_ranks(self) -> None:
        """Lightning's rank-zero-only output is this worker's rank's."""
        from lightning_fabric.utilities.rank_zero import rank_zero_only as fabric_zero
        from pytorch_lightning.utilities.rank_zero import rank_zero_only

        for zero in (rank_zero_only, fabric_zero):
            setattr(zero, "rank", self.global_rank)  # noqa: B010 - its documented way

    # --- joining the job --------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        if self.ft is None:
            self.ft = init(**self._init)  # (a warm spare that ran ahead takes its order here)
            self.slot = (self.ft.config.rank, self.ft.config.world_size)
            self.setup_environment_ranks()
            self.sigterm = signal.getsignal(signal.SIGTERM)  # (fastft's: a drain)
        ft = self.ft
        if not module.automatic_optimization:
            ft.refuse(
                "FastFTStrategy: manual optimization (automatic_optimization = False) is not "
                "supported yet: fastft makes each optimizer step a transaction, and a "
                "training_step that steps optimizers itself has no step boundary to roll back "
                "to; use automatic optimization, or a plain loop with ft.transaction()"
            )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler:
            ft.refuse(
                "FastFTStrategy: precision '16-mixed' steps the optimizer through its "
                "GradScaler, outside fastft's commit; use precision='bf16-mixed' or '32-true'"
            )
        cast(Any, trainer).callbacks.append(Capture(self))
        schedulers: dict[str, Any] = {
            f"lr_scheduler_{i}": c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)
        }
        opt = self.optimizers[0] if len(self.optimizers) == 1 else list(self.optimizers)
        self.loops.capture(trainer)  # (step 0's, for a peer that joins before a commit)
        ft.register(model=module, optimizer=opt, lightning_loops=self.loops, **schedulers)
        self.resumed = self.loops.restore(trainer)  # (a heal or a durable restore)
        if self.resumed:
            log.info(
                "fastft: resuming Lightning at step %d (epoch %d)", ft.step, trainer.current_epoch
            )

    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or self.ft is None:
            return dataloader
        if (why := why_not(dataloader)) is not None:
            self.ft.refuse(
                f"FastFTStrategy: the train loader is {why}: a restarted worker could not "
                "resume it at the batch after the last commit. Use a map-style Dataset in a "
                "DataLoader (Lightning gives it a DistributedSampler), or a loader with "
                "state_dict()/load_state_dict() (torchdata's StatefulDataLoader)"
            )
        batches = cast(Any, trainer).fit_loop.epoch_loop.batch_progress.current
        return resumable(dataloader, lambda: batches.processed)

    # --- the step ---------------------------------------------------------------------------
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """One micro-batch of the step's transaction: the first opens it, the last reduces
        and commits it; after a rollback the step runs again from its first micro-batch
        (the closures keep their batches) until it commits."""
        model = model if isinstance(model, LightningModule) else self.lightning_module
        assert model is not None and self.ft is not None
        trainer = model.trainer
        # Lightning's own test (_should_accumulate) for a strategy that accumulates itself:
        # the step ends once the window's batches are all in, the epoch's end or not
        ready = cast(Any, trainer).fit_loop.epoch_loop.batch_progress.current.ready
        last = ready % trainer.accumulate_grad_batches == 0
        while True:
            try:
                if self.tx is None:
                    self._begin(trainer.global_step)
                    for again in self._kept:  # (a rollback dropped their gradients)
                        self._run(again)
                else:
                    self.held.resume()  # (a peer's fault while Lightning fetched the batch)
                out = self._run(closure)
                if not last:
                    self._kept.append(closure)
                    self.held.pause()
                    return out
                assert self.tx is not None
                self.tx.allreduce_gradients()
                # Lightning's on_before_optimizer_step hooks and its clipping, on the
                # averaged gradients (the commit steps the optimizer)
                self._before_commit(model, optimizer)
            except BaseException as e:
                if self.held.close(e):
                    continue  # rolled back: the step again
                raise
            if self.held.close(None):
                self._kept = []
                self.committed = True
                return out

    def _before_commit(self, model: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """Lightning's ``on_before_optimizer_step`` hooks and its gradient clipping, on the
        averaged gradients: its precision plugin's ``optimizer_step``, whose closure (run
        by the optimizer's ``step``) is already done, and whose ``step`` is the commit's,
        not this one's (the optimizer's own ``step`` is shadowed for the call)."""
        own = vars(optimizer).get("step")  # (an instance's own step, if the script set one)
        optimizer.step = lambda closure=None, **kw: closure()  # type: ignore[method-assign]
        try:
            self.precision_plugin.optimizer_step(optimizer, model=model, closure=lambda: None)
        finally:
            if own is None:
                del optimizer.step  # (the class's again: the commit steps it)
            else:
                optimizer.step = own  # type: ignore[method-assign]

    def _run(self, closure: Callable[[], Any]) -> Any:
        """A micro-batch's closure: its reductions (``all_gather``, ``reduce``) are the
        members' (every member runs the same closures in the same order)."""
        self.stepping = self.tx
        try:
            return closure()
        finally:
            self.stepping = None

    def _begin(self, global_step: int) -> None:
        assert self.ft is not None
        tx = self.held.open(self.ft)
        if tx.step != global_step:
            raise RuntimeError(
                f"fastft: this worker's Lightning loop is at step {global_step}, the job's "
                f"committed state at step {tx.step} (a heal while it was behind): it ends, "
                "and comes back as a restarted worker"
            )

    def on_validation_start(self) -> None:
        """An evaluation between two micro-batches of a step (``val_check_interval`` in
        batches that ``accumulate_grad_batches`` does not divide) sees the committed
        state: the BatchNorm statistics the step began with, the same on every member,
        not this member's micro-batches' own (DDP shows rank 0's)."""
        super().on_validation_start()
        if self.tx is None or self.ft is None or self.model is None:
            return
        began = self.ft.registry.snapshot.get("buffers")
        if began is None:
            return
        buffers = list(self.model.buffers())
        self._held_buffers = [b.detach().clone() for b in buffers]
        with torch.no_grad():
            for b, saved in zip(buffers, began, strict=True):
                b.copy_(saved)

    def on_validation_end(self) -> None:
        held, self._held_buffers = self._held_buffers, None
        if held is not None and self.model is not None:
            with torch.no_grad():
                for b, mine in zip(self.model.buffers(), held, strict=True):
                    b.copy_(mine)  # (the step's micro-batches go on from their own)
        super().on_validation_end()

    # --- collectives ------------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Inside a step's closure, over the members (``tx.allreduce``); elsewhere this
        member's value: evaluation runs on every member over the same data, and
        Lightning's own syncs of logged values (after the closure, at times a restarted
        worker does not share) would be collectives the members do not all run."""
        tx = self.stepping
        if tx is None or not isinstance(tensor, torch.Tensor):
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "sum").lower()
        if op not in ("sum", "mean", "avg"):
            raise ValueError(f"FastFTStrategy.reduce: op {reduce_op!r} (sum or mean only)")
        out = tensor.detach().clone()
        tx.allreduce([out])
        if op in ("mean", "avg"):  # (as Lightning's DDP: an integer's mean is a float)
            out = out / tx.world if out.is_floating_point() else out.float() / tx.world
        return out

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        tx = self.stepping
        if tx is None:
            return tensor.unsqueeze(0)  # (outside a step: this member's, every member's)
        out = torch.zeros((tx.world, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        out[tx.rank] = tensor.detach()
        tx.allreduce([out])
        return out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        if self.stepping is None:
            return bool(decision)  # (every member decided on the same data)
        return super().reduce_boolean_decision(decision, all=all)

    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for: the members meet in each step's transaction."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj  # (a checkpoint's path, a decision: every member computes the same)

    # --- the end ----------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        ft, self.ft = self.ft, None
        if ft is not None and not self._failed:
            ft.close()
        if self.cluster_environment is None:  # (Lightning's connector gives it one)
            self.cluster_environment = LightningEnvironment()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__)
