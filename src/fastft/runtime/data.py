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
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

__all__ = ["Batches"]

KEEP = 256
"""The most batches kept for a rollback (those drawn since the next-to-last state taken);
a rollback further back loads the loader's state instead."""


class _Loader(Protocol):
    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class Batches:
    """An endless iterator over ``loader``'s batches (epoch after epoch) whose position is
    registered state: ``load_state_dict`` rewinds it, and the next batch comes from there."""

    def __init__(self, loader: _Loader) -> None:
        for name in ("state_dict", "load_state_dict", "__iter__"):
            if not callable(getattr(loader, name, None)):
                raise TypeError(
                    f"{type(loader).__name__} has no {name}(): use a stateful loader "
                    "(torchdata.stateful_dataloader.StatefulDataLoader) or add one"
                )
        self.loader = loader
        self.epoch = 0
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
        return batch

    def _draw(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
        raise RuntimeError(f"{type(self.loader).__name__} yields no batch at all")

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
                "loader": self.loader.state_dict(),
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
        self.loader.load_state_dict(state["loader"])
        self._state = state  # not asked of the loader before it yields again

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
        self.loader.load_state_dict(base["loader"])
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
