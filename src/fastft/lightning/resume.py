"""What of a Lightning ``Trainer`` a commit holds besides the model, the optimizer and the
schedulers: its loops' progress, its callbacks', the datamodule's and the precision
plugin's state, and the train loader's place in the epoch. fastft registers it as one more
object (:class:`LoopState`): a heal sends it, the durable tier saves it, the replica check
compares it; a restarted worker restores it as Lightning's resume from a checkpoint
(``Trainer.fit(ckpt_path=...)``) does, so its loop goes on at the batch after the last
commit, its callbacks where theirs were.

:class:`Skipping` is the train loader's sampler made resumable: Lightning keeps the state
of a loader that has one in its loops' (``_Stateful``), and an ordinary ``DataLoader``
would begin its epoch again after a restart (Lightning warns "your dataloader is not
resumable" and trains on the wrong batches)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["LoopState", "Skipping", "resumable"]


class LoopState:
    """The Trainer's state as of the last commit, as a registered object.
    :meth:`capture` takes it after each batch whose step committed (and once before the
    first step); :meth:`state_dict` returns that, not the live loops, which are a batch
    further inside a step. :meth:`load_state_dict` keeps what it is given for
    :meth:`restore` (a heal or a durable restore before the loop runs); a rollback's
    restore inside the loop gives back what it took, and changes nothing."""

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None

    def capture(self, trainer: Any) -> None:
        pl_module = trainer.lightning_module
        held: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "loops": {"fit_loop": trainer.fit_loop.state_dict()},
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        }
        held["callbacks"] = {k: v for k, v in held["callbacks"].items() if v}
        if (dm := trainer.datamodule) is not None and (st := dm.state_dict()):
            held[type(dm).__qualname__] = st
        if st := trainer.precision_plugin.state_dict():
            held[type(trainer.precision_plugin).__qualname__] = st
        extra: dict[str, Any] = {}
        pl_module.on_save_checkpoint(extra)  # (the module's own keys, as in a checkpoint)
        held["module_extra"] = extra
        self.held = copy.deepcopy(held)

    def state_dict(self) -> dict[str, Any]:
        return self.held

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state is self.held or state == self.held:
            return  # (a rollback: what the step began with)
        self.held = copy.deepcopy(state)
        self.loaded = self.held

    def restore(self, trainer: Any) -> bool:
        """Give the Trainer what was loaded (a heal, a durable restore) as Lightning's own
        resume from a checkpoint restores it, through each part's public
        ``load_state_dict`` and ``on_load_checkpoint``: the loops (at the batch after the
        last commit), the callbacks, the datamodule, the precision plugin and the module's
        own keys. The model, the optimizers and the schedulers came with the heal. False
        if nothing was loaded, or the state of step 0 (a start is no resume)."""
        got, self.loaded = self.loaded, None
        if not got or not got.get("global_step"):
            return False
        ckpt = {k: v for k, v in got.items() if k != "module_extra"}
        ckpt.update(got.get("module_extra", {}))
        ckpt["state_dict"] = trainer.lightning_module.state_dict()  # (as healed)
        trainer.lightning_module.on_load_checkpoint(ckpt)
        if (dm := trainer.datamodule) is not None and type(dm).__qualname__ in ckpt:
            dm.load_state_dict(ckpt[type(dm).__qualname__])
        states = ckpt.get("callbacks", {})
        for cb in trainer.callbacks:
            cb.on_load_checkpoint(trainer, trainer.lightning_module, ckpt)
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])
        precision = trainer.precision_plugin
        precision.on_load_checkpoint(ckpt)
        if type(precision).__qualname__ in ckpt:
            precision.load_state_dict(ckpt[type(precision).__qualname__])
        trainer.fit_loop.load_state_dict(ckpt["loops"]["fit_loop"])
        return True


class Skipping:
    """A sampler that leaves out the first ``skip`` batches of the next pass over it (a
    resumed epoch's): ``batch_size`` indices each. ``set_epoch`` reaches the sampler it
    wraps (Lightning sets the epoch of both a loader's sampler and its batch sampler's)."""

    def __init__(self, inner: Any, batch_size: int) -> None:
        self.inner = inner
        self.batch_size = batch_size
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        if callable(f := getattr(self.inner, "set_epoch", None)):
            f(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip * self.batch_size, 0
        for i, index in enumerate(self.inner):
            if i >= skip:
                yield index


def resumable(loader: Any, position: Callable[[], int]) -> Any:
    """``loader`` (a ``DataLoader`` with an automatic batch sampler) made resumable in
    place: its batch sampler's sampler becomes :class:`Skipping`, and the loader gets
    ``state_dict()`` (``position()``: the batches of its epoch the last commit consumed)
    and ``load_state_dict()``, so Lightning keeps its place with the loops'. Returns the
    loader; one it cannot resume (an iterable dataset, a batch sampler of the script's)
    comes back as it was, and :func:`why_not` says why; one that keeps its own place
    (a ``StatefulDataLoader``) too."""
    if callable(getattr(loader, "state_dict", None)) or why_not(loader) is not None:
        return loader
    bs = loader.batch_sampler
    skipping = Skipping(bs.sampler, bs.batch_size)
    bs.sampler = skipping
    loader.state_dict = lambda: {"batches": position()}
    loader.load_state_dict = lambda st: setattr(skipping, "skip", int(st.get("batches", 0)))
    return loader


def why_not(loader: Any) -> str | None:
    """Why :func:`resumable` cannot resume ``loader`` (None: it can)."""
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset

    if callable(getattr(loader, "state_dict", None)):
        return None  # (it keeps its own place: Lightning saves it with the loops)
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset (its place in a stream is the dataset's own)"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"a batch sampler of its own ({type(loader.batch_sampler).__name__})"
    return None
