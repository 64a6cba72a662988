"""The step's vote carried in its gradients' own allreduce (:class:`InBand`).

With the decision by collective (docs/architecture.md, "The fault-free decision") a step
commits on an allreduce after its gradients that every member completed and that no
member flagged (a drain, a joiner, different batches). That allreduce is a second round of
wake-ups per step: on 3 Gloo workers sharing 2 cores it cost more than the store's vote,
and on NCCL at scale it is one more latency-bound collective. The gradients' allreduce is
already one every member enters only with its gradients ready, so the vote rides it: the
gradient bucket ends in :data:`SLOTS` elements (:class:`~.bucket.GradBucket`) that
each member fills with its flags and its batch digest before the allreduce, and reads
summed after it. What the sums say is the same on every member that completed it:

- the flags (a drain, a joiner) are 0 or 1 each: their sum is nonzero iff any member
  raised one;
- the batch digest (62 bits) goes as 16 nibbles ``c`` and their squares: every member
  drew the same batches iff, for every nibble, ``(Σc)² == N·Σc²`` (equality in
  Cauchy-Schwarz: all ``c`` equal), a predicate of the sums alone, so no member reads it
  differently from another. A mismatch falls back to the agreement's own allreduce,
  which names the digests (every member falls back alike).

Each sum is an integer below 2**24 up to 74,565 members (15² · N), exact in float32 and
float64; a bucket of another type (bf16, fp16) carries no vote and the agreement runs its
own allreduce as before. ``fastft.jax``'s ``tx.pmean`` ends its flat buffer in the same
slots (:func:`fastft.runtime.sync.reduce_flat`). A step of the in-band replica check (every ``--compare-every``)
also runs it: the checksums are many 64-bit integers (an allreduce every 40 steps).

The pure part (:func:`encode`, :func:`decode`) is tested alone; :class:`InBand` holds what
the current attempt's allreduce said."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SLOTS", "InBand", "Outcome", "decode", "encode", "exact"]

NIBBLES = 16
SLOTS = 2 + 2 * NIBBLES
"""Slots at the end of the bucket: drain, join, then each nibble and its square."""

_MAX_MEMBERS = {torch.float32: (1 << 24) // 225, torch.float64: (1 << 53) // 225}


def exact(dtype: torch.dtype, members: int) -> bool:
    """Whether a bucket of ``dtype`` sums the slots of ``members`` exactly."""
    return members <= _MAX_MEMBERS.get(dtype, 0)


def encode(drain: bool, join: bool, digest: int) -> list[float]:
    """One member's slots: its flags, then its digest's nibbles and their squares."""
    nib = [(digest >> (4 * i)) & 0xF for i in range(NIBBLES)]
    return [float(drain), float(join), *map(float, nib), *(float(c * c) for c in nib)]


@dataclass(frozen=True)
class Outcome:
    """What a completed allreduce's summed slots say (the same on every member)."""

    flagged: bool
    """A member drains or saw a joiner: the store's vote decides (it names them)."""
    same_batches: bool
    """Every member drew the same batches (else the agreement's allreduce names them)."""


def decode(summed: list[float], members: int) -> Outcome:
    """Read the summed slots of ``members`` members."""
    s = list(map(round, summed))
    sums, squares = s[2 : 2 + NIBBLES], s[2 + NIBBLES :]
    same = [a * a for a in sums] == [members * b for b in squares]
    return Outcome(flagged=bool(s[0] or s[1]), same_batches=same)


class InBand:
    """The in-band vote of one worker's current attempt: what its gradients' allreduce
    carried and said (:meth:`read`), None until it completed in this attempt."""

    def __init__(self) -> None:
        self.outcome: Outcome | None = None
        self._mine: tuple[tuple[bool, bool, int, torch.dtype, torch.device], torch.Tensor]
        self._mine = ((False, False, -1, torch.float32, torch.device("cpu")), torch.empty(0))
        """The last slots filled, by what they encode (a step's are usually the last's)."""

    def begin(self) -> None:
        """An attempt begins: nothing said yet."""
        self.outcome = None

    def fill(self, slots: torch.Tensor, drain: bool, join: bool, digest: int) -> None:
        """Before the allreduce: this member's slots."""
        key = (drain, join, digest, slots.dtype, slots.device)
        if self._mine[0] != key:
            values = encode(drain, join, digest)
            self._mine = (key, torch.tensor(values, dtype=slots.dtype, device=slots.device))
        slots.copy_(self._mine[1])

    def read(self, slots: torch.Tensor, members: int) -> None:
        """After the allreduce completed: what every member's slots summed to."""
        self.outcome = decode(slots.tolist(), members)

    def take(self) -> Outcome | None:
        """The attempt's outcome, once (a retry begins with none)."""
        out, self.outcome = self.outcome, None
        return out
