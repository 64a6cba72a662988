"""Resumable batches from a stateful data loader: what a rollback, a heal and a checkpoint
restore put back, so that every sample counts once across faults.

    loader = StatefulDataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=True,
                                num_workers=2, generator=torch.Generator().manual_seed(0))
    data = fastft.Batches(loader)
    ft.register(model=model, optimizer=opt, data=data)
    while ft.step < total_steps:
        with ft.transaction() as tx:
            x, y = data.next()              # the step's global batch, the same on every member
            mine = tx.shard(len(x))          # this member's part of it
            ...

The loader yields each step's *global* batch and every member draws it: the position is
then the same on every member (S3), a heal can copy it, and ``tx.shard`` splits the
batch over whoever is alive (an elastic world re-tiles it). Any loader with
``state_dict()``/``load_state_dict()`` whose state is its position works: torchdata's
``StatefulDataLoader`` (with loader worker processes), or your own.

A rollback does not go through the loader: the batches the failed step drew are kept and
served again, so the loader's worker processes go on, and the loader's state is only ever
asked for right after it yielded a batch (a ``StatefulDataLoader`` with workers, asked
right after ``load_state_dict``, could report a position one batch behind: a healed
member then trained one batch behind its peers, which an allreduce of gradients hides).
A heal or a checkpoint restore loads the loader's state for real.

Each pass's order is a function of the pass alone. A loader's shuffle draws from its
generator, whose state at a pass's start depends on the loader's history: a torchdata
``StatefulDataLoader`` with ``num_workers=0`` restored from any state reshuffles its next
pass differently from one never restored, so members whose loaders were restored at
different steps (a heal, a restore, the start) drew different global batches from the
second pass on. ``Batches`` therefore seeds the loader's generators (the loader's and its
sampler's) from their seed at construction and the pass number before every pass it
starts; the seeds are part of its state, so a member whose state came from a peer's
shuffles as that peer does. Each sample's random draws (augmentation in the dataset's ``__getitem__``, in the main
process or in loader workers) are seeded from (seed, pass, index) too
(:mod:`fastft.runtime.state.samples`), so a sample's content is the same on every member
and after every restore. A loader of one's own with other randomness must make its order
a function of its state; the batch check (:func:`batch_digest`, compared over the members every step)
fails the job if members still draw different batches.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from fastft.runtime.state.samples import install, sample_seed, seeded

__all__ = ["Batches", "batch_digest"]

KEEP = 256
"""The most batches kept for a rollback (those drawn since the next-to-last state taken);
a rollback further back loads the loader's state instead."""


class _Loader(Protocol):
    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def _generators(loader: Any) -> list[torch.Generator]:
    """The generators a loader's order draws from: its own and its sampler's (each once)."""
    out: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (
        loader,
        getattr(loader, "sampler", None),
        getattr(batch_sampler, "sampler", None),
    ):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in out):
            out.append(g)
    return out


def _own_generators(loader: Any) -> None:
    """Give a loader (and its shuffling sampler) that draws from torch's global generator a
    generator of its own (issue 61): a ``DataLoader`` without one seeds every iterator from
    the global generator, and a restarted member that made its iterator inside the step it
    rejoined at drew that step's dropout masks from a stream shifted by it (ranks equal,
    all of them off the fault-free run). Seeded from the sampler's generator when it has
    one (the script seeded it), else a constant: the same on every member."""
    sampler: Any = getattr(loader, "sampler", None)
    theirs = getattr(sampler, "generator", None)
    seed = theirs.initial_seed() if isinstance(theirs, torch.Generator) else 0x5EED
    if hasattr(sampler, "generator") and theirs is None and hasattr(sampler, "data_source"):
        sampler.generator = torch.Generator().manual_seed(seed + 1)  # (a RandomSampler's)
    if hasattr(loader, "generator") and loader.generator is None:
        loader.generator = torch.Generator().manual_seed(seed)


def _pass_seed(seed: int, epoch: int) -> int:
    """The seed of pass ``epoch`` of a generator first seeded ``seed`` (a 63-bit mix: nearby
    seeds and passes give unrelated orders)."""
    h = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


_DIGEST_WHOLE = 1 << 16
"""A tensor of up to this many bytes is digested whole; a larger one by a strided sample
of about as many bytes (its shape and dtype always). Batches that differ (other samples,
another order) differ throughout, so a sample sees it; the digest stays well under a
millisecond a step whatever the batch (docs/measurements.md, *The batch check*)."""


def batch_digest(batch: Any) -> int:
    """A 62-bit digest of a batch (tensors, numbers, strings and their lists, tuples and
    dicts), the same on every member that drew the same batch."""
    h = hashlib.blake2b(digest_size=8)

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            flat = t.reshape(-1)
            if flat.numel() * flat.element_size() > _DIGEST_WHOLE:
                flat = flat[:: -(-flat.numel() * flat.element_size() // _DIGEST_WHOLE)]
            h.update(flat.contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(b"D")
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                visit(obj[k])
        elif isinstance(obj, list | tuple):
            h.update(b"L%d" % len(obj))
            for o in obj:
                visit(o)
        else:
            h.update(repr(obj).encode())

    visit(batch)
    return int.from_bytes(h.digest(), "little") >> 2


class Batches:
    """An endless iterator over ``loader``'s batches (epoch after epoch) whose position is
    registered state: ``load_state_dict`` rewinds it, and the next batch comes from there."""

    def __init__(self, loader: _Loader, *, seed_samples: bool = True) -> None:
        for name in ("state_dict", "load_state_dict", "__iter__"):
            if not callable(getattr(loader, name, None)):
                raise TypeError(
                    f"{type(loader).__name__} has no {name}(): use a stateful loader "
                    "(torchdata.stateful_dataloader.StatefulDataLoader) or add one"
                )
        self.loader = loader
        self.epoch = 0
        _own_generators(loader)
        self._gens = _generators(loader)
        self._seeds = [g.initial_seed() for g in self._gens]
        self._samples = (
            install(loader, self._seeds[0] if self._seeds else 0) if seed_samples else None
        )
        """The loader's dataset, seeding each sample's random draws from (seed, pass,
        index) (:mod:`.samples`); None: not a map-style dataset, or ``seed_samples=False``."""
        self._resume = False  # the loader's next iterator resumes a loaded pass: no reseed
        self._iterable = isinstance(
            getattr(loader, "dataset", None), torch.utils.data.IterableDataset
        )
        """A stream (an ``IterableDataset``): its position is fastft's own, the batches
        drawn in the pass (torchdata's, restored, counted some twice: issue 61)."""
        self._in_pass = 0  # (batches the loader yielded in this pass)
        self._skip = 0  # (a stream restored: batches its next pass's iterator skips)
        self._seed_pass()  # before any state is taken: a state of pass 0 names its order
        self.digest: int | None = None
        """Of the batches drawn since :meth:`start_step` (None: none drawn), which the
        runtime compares over the members before the vote."""
        self.guard: Callable[[], AbstractContextManager[Any]] = nullcontext
        """Set by ``ft.register``: the runtime's section that an interrupt may not tear
        (a peer's fault, raised in the main thread inside the loader's ``__next__``, left
        a ``StatefulDataLoader`` waiting forever for a batch it had already taken)."""
        self._it: Iterator[Any] | None = None
        # Positions: ``pos`` batches drawn in lineage ``_line`` (a position names the same
        # data on every member whose state came from the same loader state).
        self._line = os.urandom(8).hex()
        self._pos = 0
        self._drawn: deque[tuple[int, int, Any]] = deque(maxlen=KEEP)  # (pos, epoch, batch)
        self._again: deque[tuple[int, int, Any]] = deque()  # rolled back: served first
        self._state: dict[str, Any] | None = None  # the state at _pos, when known
        self._base: dict[str, Any] = {}  # the state last rolled back to
        self._marks: deque[int] = deque(maxlen=2)  # where the last states were taken

    def next(self) -> Any:
        """The next batch; a new epoch of the loader starts where the last one ended."""
        with self.guard():  # a peer's fault raised inside the loader could tear it
            if self._again:
                pos, self.epoch, batch = self._again.popleft()
            else:
                batch, pos = self._draw(), self._pos
            self._drawn.append((pos, self.epoch, batch))
            self._pos, self._state = pos + 1, None
            d = batch_digest(batch)
            self.digest = d if self.digest is None else batch_digest((self.digest, d))
        return batch

    def start_step(self) -> None:
        """A step attempt starts: its digest covers the batches it draws."""
        self.digest = None

    def _draw(self) -> Any:
        for _ in range(2):
            if self._it is None:
                if not self._resume:
                    self._seed_pass()
                self._resume = False
                if self._samples is not None:
                    self._samples.epoch = self.epoch  # (before its workers start)
                # (an iterator made inside a step draws nothing from its stream: a restart
                # makes one where the fault-free run did not)
                state = torch.default_generator.get_state()
                try:
                    self._it = iter(self.loader)
                    self._in_pass, skip, self._skip = 0, self._skip, 0
                    for _ in range(skip):  # (a stream's position: drawn again, dropped)
                        with self._stream_seed():
                            next(self._it)
                        self._in_pass += 1
                finally:
                    torch.default_generator.set_state(state)
            try:
                with self._stream_seed():
                    batch = next(self._it)
                self._in_pass += 1
                return batch
            except StopIteration:
                self._it = None
                self.epoch += 1
        raise RuntimeError(f"{type(self.loader).__name__} yields no batch at all")

    def _stream_seed(self) -> AbstractContextManager[Any]:
        """A stream read in this process draws its randomness (augmentation in its
        ``__iter__``) from the global generators: seeded from (seed, pass, batch) around
        each batch, the same on every member and after every restore (the step's own
        seeds are per rank). Loader workers seed themselves from the pass's seed."""
        workers: Any = getattr(self.loader, "num_workers", 0)
        if not self._iterable or workers:
            return nullcontext()
        return seeded(sample_seed(self._seeds[0] if self._seeds else 0, self.epoch, self._in_pass))

    def _seed_pass(self) -> None:
        for g, seed in zip(self._gens, self._seeds, strict=True):
            g.manual_seed(_pass_seed(seed, self.epoch))

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next()

    def state_dict(self) -> dict[str, Any]:
        if self._state is None:
            if self._again:  # a retry drew fewer batches than the step it replaces
                self._catch_up()
            self._state = {
                "line": self._line,
                "pos": self._pos,
                "epoch": self.epoch,
                "seeds": list(self._seeds),
                # (a stream's position is fastft's; a loader's own state is its position)
                **({"in_pass": self._in_pass} if self._iterable else {}),
                "loader": {} if self._iterable else self.loader.state_dict(),
            }
        if not self._marks or self._marks[-1] != self._pos:
            self._marks.append(self._pos)
        while self._drawn and self._drawn[0][0] < self._marks[0]:
            self._drawn.popleft()  # no state from before the marks is rolled back to
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pos = int(state.get("pos", -1))
        if state.get("line") == self._line and self._rewind(pos, state):
            self._state = state
            return
        self._it = None
        self._shut_down()
        self._drawn.clear()
        self._again.clear()
        self._line, self._pos = state.get("line", self._line), max(pos, 0)
        self.epoch = int(state["epoch"])
        seeds = state.get("seeds")
        if seeds is not None and len(seeds) == len(self._gens):  # the passes after this one
            self._seeds = [int(x) for x in seeds]
        self._load_loader(state)
        self._state = state  # not asked of the loader before it yields again

    def _load_loader(self, state: dict[str, Any]) -> None:
        """Put the loader where ``state`` was: its own state, or for a stream the pass
        started again (seeded as it was) with the batches drawn in it skipped."""
        if self._iterable:
            self._skip, self._resume = int(state.get("in_pass", 0)), False
            return
        self.loader.load_state_dict(state["loader"])
        self._resume = True

    def _rewind(self, pos: int, state: dict[str, Any]) -> bool:
        """Serve the batches drawn since ``pos`` again, if they were kept (a rollback)."""
        if pos == self._pos:
            self._base = state if not self._again else self._base
            return True
        back = [d for d in (*self._drawn, *self._again) if d[0] >= pos]
        if pos > self._pos or not back or back[0][0] != pos:
            return False
        self._drawn = deque((d for d in self._drawn if d[0] < pos), maxlen=KEEP)
        self._again = deque(back)
        self._pos, self.epoch, self._base = pos, int(state["epoch"]), state
        return True

    def _catch_up(self) -> None:
        """Bring the loader to ``_pos`` while rolled-back batches are still to be served
        (a retry that drew fewer batches than the step it replaced, then committed): load
        the state rolled back to and draw the served batches again from the loader."""
        base, served = self._base, self._pos - int(self._base["pos"])
        self._again.clear()
        self._it = None
        self._shut_down()
        self._load_loader(base)
        self.epoch = int(base["epoch"])
        for _ in range(served):
            self._draw()

    def _shut_down(self) -> None:
        """End the loader's current iterator's worker processes now, on this thread.
        Dropped instead, the iterator (in a reference cycle) was shut down by whichever
        thread the garbage collector next ran on (seen: the checkpoint writer, stalled 10
        s in its joins), and a loader worker forked meanwhile inherited it and ran its
        ``__del__`` too ("can only test a child process")."""
        it = getattr(self.loader, "_iterator", None)
        shut = getattr(it, "_shutdown_workers", None)
        if callable(shut):
            shut()
