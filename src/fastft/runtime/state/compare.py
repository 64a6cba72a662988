"""The in-band replica check (S3): the members of an epoch compare a checksum of their whole
replicated state, item by item, in the allreduce the step makes before its vote.

What is compared is the state a step *begins* with: the last commit's whole effect,
the script's post-commit code included (a scheduler stepped under ``if tx.committed:``),
which is also what a heal sends and a checkpoint keeps. Items, each named in a mismatch:
the model's parameters, its buffers (BatchNorm statistics), the optimizer (its state and
its ``param_groups``: a learning rate), every other registered object by its name (a
scheduler, ``fastft.Batches``' position, an EMA copy, the script's own state), DiLoCo's
outer state and each of ``fastft.jax``'s pytrees.

The checksum of a tensor is the sum of its bits taken as 64-bit integers (wrapping), a
pass over memory at its bandwidth; the structure around the tensors (shapes, dtypes,
every number and string of a ``state_dict()``) is hashed whole. A large tensor is read in
part: every :data:`SAMPLE`-th chunk of :data:`CHUNK` words, the chunks rotating from one
periodic check to the next, so a check reads a quarter of the state and four checks all
of it (the whole check was 5.9 ms for the 4.2M-parameter model with Adam on 2 busy cores:
docs/measurements.md, *The replica check*). What it can miss: a difference confined to
chunks a check did not read (found by one of the next three), and two changes that
cancel in the sum (bits moved between two words, one word up by exactly what another is
down). It is a check against divergence, not against an adversary: a diverged replica
differs in almost every word.

Pure but for the torch arithmetic: :func:`checksums` computes, :func:`vector` lays the
checksums out for the allreduce, :func:`verdict` reads the gathered rows and says what
differs, where and why.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import fastft.runtime.state.tree as tree
from fastft.runtime.groups.hsdp import local

if TYPE_CHECKING:
    from fastft.runtime.state.registry import StateRegistry

__all__ = [
    "RECUR_STEPS",
    "SLOTS",
    "Repair",
    "Verdict",
    "cause",
    "checksum",
    "checksums",
    "repair",
    "row",
    "vector",
    "verdict",
]

SLOTS = 12
"""Items compared by name; the rest share the last slot (a fixed-length vector: members
whose registrations differ still run the same collective, and differ in the names slot)."""


def _mix(h: Any, x: int) -> None:
    h.update(int(x & (2**64 - 1)).to_bytes(8, "little"))


CHUNK = 2048
"""Words (8 bytes) per chunk of a large tensor; a check sums one chunk in :data:`SAMPLE`."""
SAMPLE = 4
"""A tensor of at least ``SAMPLE`` chunks is summed over every ``SAMPLE``-th chunk, the
chunks taken rotating from check to check: each check reads a quarter of the state's
memory, and ``SAMPLE`` consecutive checks read all of it."""


def _tensor_sums(tensors: Sequence[torch.Tensor], turn: int = 0) -> list[int]:
    """The 64-bit wrapping sum of each tensor's bits (one device sync per device); of
    chunks ``turn % SAMPLE``, ``+ SAMPLE``, ... of a large one."""
    sums: list[torch.Tensor] = []
    for t in tensors:
        b = t.detach()
        if b.dtype == torch.bool:
            b = b.to(torch.uint8)
        b = b.contiguous().reshape(-1).view(torch.uint8)
        n8 = b.numel() // 8 * 8
        try:
            words = b[:n8].view(torch.int64)
        except RuntimeError:  # (a storage offset that is not 8-byte aligned)
            words = b[:n8].clone().view(torch.int64)
        rows = words.numel() // CHUNK
        if rows >= SAMPLE:
            full = words[: rows * CHUNK].view(rows, CHUNK)
            s = full[turn % SAMPLE :: SAMPLE].sum() + words[rows * CHUNK :].sum()
        else:
            s = words.sum()
        if n8 != b.numel():
            s = s + b[n8:].to(torch.int64).sum() * 1_000_003
        sums.append(s)
    if not sums:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    out = [0] * len(sums)
    for idx in by_device.values():
        values = torch.stack([sums[i] for i in idx]).cpu().tolist()
        for i, v in zip(idx, values, strict=True):
            out[i] = int(v)
    return out


def checksum(state: Any, name: str = "state", turn: int = 0) -> int:
    """A 62-bit checksum of ``state`` (a ``state_dict()`` result, a list of tensors): equal
    on members that hold equal state (see the module for what it can miss). ``turn``:
    which quarter of a large tensor's chunks it reads (members must agree on it)."""
    tensors: list[torch.Tensor] = []
    structure = tree.dump(state, tensors, name)
    h = hashlib.blake2b(structure, digest_size=8)
    for t, s in zip(tensors, _tensor_sums(tensors, turn), strict=True):
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        _mix(h, s)
    return int.from_bytes(h.digest(), "little") >> 2


def replica_items(
    registry: StateRegistry, *, replicated: bool, local_steps: bool = False
) -> list[tuple[str, Any]]:
    """What the in-band replica check compares, by name, of ``registry`` as the step
    began: from the step's snapshot where the step body may change it (buffers, the
    optimizer's settings, other objects), else as it is (the parameters and the
    optimizer's state change at the commit only; an optimizer state a heal sends
    while the step runs has arrived by the vote). ``replicated``: whether the
    parameters, buffers and optimizer are the replica groups' common state at this
    step (not with ``--sync every-k:N`` between syncs, nor ever with DiLoCo, whose
    anchor is). ``local_steps`` (those policies): of the other objects only those
    every group advances alike whatever its parameters (a torch scheduler, the data
    position); an EMA of a group's own parameters is the group's own."""
    snap = registry.snapshot
    out: list[tuple[str, Any]] = []
    if registry.model is not None and replicated:
        out.append(("parameters", registry.local_parameters()))
        if "buffers" in snap:
            out.append(("buffers", snap["buffers"]))
    if registry.optimizer is not None and replicated:
        opt = local(registry.optimizer.state_dict())  # (its state changes at the commit only)
        groups = snap.get("param_groups", opt["param_groups"])
        out.append(("optimizer", {"state": opt["state"], "param_groups": groups}))
    for name, obj in registry.others.items():
        if local_steps and not _alike_in_every_group(obj):
            continue
        out.append((name, snap[name] if name in snap else obj.state_dict()))
    if registry.outer is not None:
        out.append(("outer", list(registry.outer.tensors())))
    if registry.by_reference is not None:
        for name, leaves in registry.by_reference.state_dict().items():
            out.append((f"pytree {name}", leaves))
    return out


def _alike_in_every_group(obj: Any) -> bool:
    """Whether registered ``obj`` advances alike in replica groups that step on their own
    parameters (``every-k``, ``diloco``): a torch scheduler, ``fastft.Batches``."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    from fastft.runtime.state.data import Batches

    return isinstance(obj, LRScheduler | ReduceLROnPlateau | Batches)


def checksums(items: Iterable[tuple[str, Any]], turn: int = 0) -> list[tuple[str, int]]:
    """(name, :func:`checksum`) of each (name, state)."""
    return [(name, checksum(state, name, turn)) for name, state in items]


def _names_digest(names: Sequence[str]) -> int:
    h = hashlib.blake2b("\0".join(names).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 2


def row(sums: Sequence[tuple[str, int]]) -> list[int]:
    """One member's checksums in the fixed layout: the names' digest, then :data:`SLOTS`
    items (the items past the last slot mixed into it)."""
    names = [n for n, _ in sums]
    out = [_names_digest(names)] + [0] * SLOTS
    for i, (_, v) in enumerate(sums):
        j = 1 + min(i, SLOTS - 1)
        out[j] = v if i < SLOTS else ((out[j] * 1_000_003) ^ v) & (2**62 - 1)
    return out


def vector(sums: Sequence[tuple[str, int]]) -> list[int]:
    """What a member adds to the step's MAX allreduce: each value of :func:`row` and its
    negation (the maximum and minus the minimum over the members: equal when every member
    holds the same)."""
    r = row(sums)
    return [v for x in r for v in (x, -x)]


def differs(reduced: Sequence[int]) -> bool:
    """Whether the reduced :func:`vector` says some member holds other state."""
    return any(reduced[i] != -reduced[i + 1] for i in range(0, len(reduced), 2))


@dataclass(frozen=True)
class Verdict:
    """What differs: ``items`` (names; ``"registered names"`` if the members registered
    different objects), ``minority`` (the members, by rank, that hold another value than
    the most common one), and the message that says where to look."""

    items: tuple[str, ...]
    minority: tuple[int, ...]
    message: str
    majority: bool = True
    """Whether more than half the members hold the most common value of every item that
    differs (with 2 members, never: which one is right cannot be told)."""


_CAUSES = {
    "parameters": (
        "the parameters differ: something changed them outside the step's commit (an "
        "update of the script's own, not through the registered optimizer), or the model "
        "was built differently on some members (a seed per rank)"
    ),
    "optimizer": (
        "the optimizer differs (its state or a param_groups setting such as the learning "
        "rate): a setting changed by hand outside the transaction, or a scheduler that "
        "is not registered with ft.register"
    ),
    "buffers": (
        "the model's buffers differ (BatchNorm running statistics): each member updates "
        "them from its own part of the batch; leave --buffers at average (the default)"
    ),
}


def cause(item: str) -> str:
    """The likely cause of a mismatch in ``item``."""
    if item in _CAUSES:
        return _CAUSES[item]
    if item.startswith("pytree "):
        return (
            f"the {item[7:]} pytree differs: in JAX, state kept in the script's own "
            "variables (params = update(params, ...)) is not what a heal or a restore "
            "gives back; read the state from ft.state and propose the new one every "
            "step (tx.propose(...)), never train on a local copy"
        )
    if item == "registered names":
        return "the members registered different objects: every member registers the same"
    return (
        f"the registered {item!r} differs: it changed outside the commit (a scheduler "
        "stepped, a counter updated outside `if tx.committed:` or between a rollback and "
        "its retry), or its state depends on the process (a seed per rank)"
    )


def verdict(step: int, epoch: int, names: Sequence[str], rows: dict[int, Sequence[int]]) -> Verdict:
    """What the members' :func:`row` values (by rank) say about the state of ``step``."""
    slots = ["registered names", *names[: SLOTS - 1]]
    if len(names) > SLOTS - 1:
        slots.append(" / ".join(names[SLOTS - 1 :]))
    width = len(next(iter(rows.values())))
    bad: list[str] = []
    majority = True
    minority: set[int] = set()
    detail: list[str] = []
    for j in range(min(width, len(slots))):
        values = Counter(r[j] for r in rows.values())
        if len(values) == 1:
            continue
        common = values.most_common(1)[0][0]
        odd = sorted(rank for rank, r in rows.items() if r[j] != common)
        most = 2 * values[common] > len(rows)
        majority = majority and most
        bad.append(slots[j])
        minority.update(odd)
        if most:
            detail.append(
                f"{slots[j]!r} differs on rank{'s' if len(odd) > 1 else ''} "
                f"{', '.join(map(str, odd))} (from the {len(rows) - len(odd)} others)"
            )
        else:  # (a tie, 2 members: naming one would blame a healthy member half the time)
            detail.append(
                f"{slots[j]!r} differs between ranks {', '.join(map(str, sorted(rows)))} "
                "(no majority: which of them holds the right value cannot be told)"
            )
        if j == 0:
            break  # (another layout: the slots do not name the same items)
    first = bad[0] if bad else "state"
    message = (
        f"the replicas diverged: at the start of step {step} (epoch {epoch}) "
        f"{'; '.join(detail) or 'the state differs'}. Likely cause: {cause(first)}"
    )
    return Verdict(tuple(bad), tuple(sorted(minority)), message, majority)


_STOP = (
    "The job stops rather than train on different replicas (the in-band replica check, "
    "--compare-every)"
)
RECUR_STEPS = 50
"""The same items differing again within this many steps of their heal: the script's."""


@dataclass(frozen=True)
class Repair:
    """What the members do about a :class:`Verdict` (:func:`repair`): ``rewind`` (every
    member declares its state lost and the next epoch restores each one's copy of the
    last verified state, :class:`~fastft.runtime.state.verified.Verified`), ``heal`` (the
    minority declares its state lost and heals from a peer of the majority; the step
    rolls back), ``retry`` (every member rolls the step back and it runs, and is compared,
    again), ``restore`` (every member declares its state lost: the durable tier restores
    the job), or ``stop`` (the job ends, with ``why``)."""

    action: str
    why: str


def repair(
    v: Verdict,
    *,
    step: int,
    healed: Mapping[tuple[str, ...], int],
    retried: tuple[int, tuple[str, ...]] | None,
    durable: bool,
    fresh: bool = False,
    verified: int | None = None,
) -> Repair:
    """Silent data corruption, repaired (issues 50, 61): the replicas are bitwise equal
    after every commit, so a member that differs holds corrupted state, or the script
    keeps state fastft does not see.

    * A step ran again for this mismatch (``retried``: the step and items of the last
      retry) and it held: the state itself differs, and nothing tells which is right:
      the durable tier restores the job (``durable``), or it stops.
    * ``fresh``: the check of the first two steps of an epoch that healed members: a heal
      that missed something, or state the script keeps in its own variables (JAX
      parameters in locals), which a majority of freshly healed members may share: the
      job stops, as it always did.
    * The same items differing again within :data:`RECUR_STEPS` of their repair
      (``healed``: items -> the step they were repaired at) after a rewind, or with a
      majority: the script's doing (a rewind runs the same steps again), and it stops.
    * ``verified``: every member holds the state of that step, whose check passed
      (:class:`~fastft.runtime.state.verified.Verified`): every member goes back to it and
      runs the steps since again, so the corrupted member's gradients of those steps are
      in nobody's state: the fault-free run, bit for bit.
    * Else, a majority: the minority heals from it.
    * No majority (2 members, or no value held by more than half): the step runs again;
      a mismatch of the computation is gone then."""
    if retried == (step, v.items):
        if durable:
            return Repair(
                "restore",
                f"the replicas still differ at step {step} ({', '.join(v.items)}) after it "
                "ran again, with no majority: every member's state is suspect; the durable "
                "tier restores the last checkpoint",
            )
        return Repair(
            "stop",
            f"{v.message}. It held after the step ran again, with no majority (2 replicas, "
            "or no value on more than half) and no durable tier (--checkpoint-dir) to "
            f"restore from: nothing can repair it. {_STOP}",
        )
    if fresh:
        return Repair("stop", f"{v.message}. {_STOP}")
    repairable = verified is not None or (v.majority and v.minority)
    if repairable and v.items in healed and step - healed[v.items] <= RECUR_STEPS:
        return Repair(
            "stop",
            f"{v.message}. The same items differed again after their repair at step "
            f"{healed[v.items]} (every member back to its last verified state, or the "
            "minority healed from the majority): not a corrupted replica but state the "
            f"script changes outside the commit, or on one rank only. {_STOP}",
        )
    if verified is not None:
        who = f" on rank{'s' if len(v.minority) > 1 else ''} " if v.minority else ""
        return Repair(
            "rewind",
            f"the replicas diverged at step {step}: {', '.join(v.items)}"
            f"{who}{', '.join(map(str, v.minority))} differs (silent data corruption?); "
            f"every member goes back to the state of step {verified}, which the check "
            f"there found equal, and runs steps {verified}..{step - 1} again",
        )
    if v.majority and v.minority:
        return Repair(
            "heal",
            f"the replicas diverged at step {step}: {', '.join(v.items)} on rank"
            f"{'s' if len(v.minority) > 1 else ''} {', '.join(map(str, v.minority))} "
            "differs from the majority (silent data corruption?); the minority heals from "
            "the majority and the step runs again",
        )
    return Repair(
        "retry",
        f"the replicas diverged at step {step} ({', '.join(v.items)}) with no majority "
        "to tell which is right; the step runs again and is compared again",
    )
