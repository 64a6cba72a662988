"""Random augmentation that is the same on every member: each sample's random draws are a
function of (seed, pass, sample index), wherever the sample is loaded.

A torchvision-style transform draws from the global RNGs (torch's, Python's, NumPy's) in
the dataset's ``__getitem__``. In a loader worker process those are seeded from the
loader's ``base_seed + worker_id``, which is not in the loader's state, and in the main
process they hold whatever the step drew before: two members that drew the same indices
then built different samples (a crop here, a flip there), a restarted member other ones
than its first life, and the batch check stopped the job at the first fault.
:class:`SeededSamples` wraps a map-style dataset: around each ``__getitem__`` it seeds
the three RNGs from (seed, pass, index) and puts the caller's states back after, so a
sample's content, not only the order, is a function of the data position.
:class:`fastft.Batches` installs it on its loader's dataset and tells it the pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SeededSamples", "install", "sample_seed", "seeded"]


def sample_seed(seed: int, epoch: int, index: Any) -> int:
    """The 63-bit seed of sample ``index`` in pass ``epoch``."""
    h = hashlib.blake2b(f"{seed}:{epoch}:{index!r}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


class SeededSamples(torch.utils.data.Dataset):
    """``dataset`` whose ``__getitem__`` runs with the global RNGs seeded from (``seed``,
    the pass :attr:`epoch`, the index); everything else is the wrapped dataset's."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0
        """The pass being loaded: set by :class:`fastft.Batches` before it starts one (a
        loader's worker processes take the dataset as it is when their pass starts)."""

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        with seeded(sample_seed(self.seed, self.epoch, index)):
            return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # (not set yet: unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


@contextlib.contextmanager
def seeded(s: int) -> Iterator[None]:
    """Run the block with torch's, Python's and NumPy's global generators seeded from
    ``s``; the caller's states are put back after. Also a stream's batch drawn in the
    main process (:class:`fastft.Batches`: its augmentation, from (seed, pass, batch))."""
    np = _numpy()
    saved = (
        torch.default_generator.get_state(),
        random.getstate(),
        np.random.get_state() if np is not None else None,
    )
    torch.default_generator.manual_seed(s)
    random.seed(s)
    if np is not None:
        np.random.seed(s & (2**32 - 1))
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        random.setstate(saved[1])
        if np is not None:
            np.random.set_state(saved[2])


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch
        return None
    return numpy


def install(loader: Any, seed: int) -> SeededSamples | None:
    """Wrap ``loader``'s map-style dataset in :class:`SeededSamples` (once); None for a
    loader without one (an iterable dataset, a loader of one's own). A loader whose
    workers persist across passes is refused: they would keep the pass they started in."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, SeededSamples):
        return dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    if not callable(getattr(dataset, "__getitem__", None)):
        return None
    if getattr(loader, "persistent_workers", False):
        raise ValueError(
            "fastft.Batches: the loader's persistent_workers=True keeps its worker processes "
            "across passes, so they cannot learn the pass that seeds each sample's random "
            "augmentation; use persistent_workers=False, or Batches(loader, "
            "seed_samples=False) if the dataset draws no random numbers"
        )
    wrapped = SeededSamples(dataset, seed)
    # (a DataLoader refuses a new dataset once built; its iterators read the attribute)
    object.__setattr__(loader, "dataset", wrapped)
    return wrapped
