"""The heartbeat file's contents (:class:`Beat`) as the agent reads them
(:func:`read_heartbeat`), and the rules that judge them: a hang's limit from the life's
pace, a straggler's figures. Pure: the writer is :mod:`fastft.process.heartbeat`."""

from __future__ import annotations

import enum
import signal
import statistics
import struct
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "BEAT_FORMAT",
    "BEAT_SIZE",
    "HANG_FLOOR_S",
    "HANG_PACES",
    "PACE_WINDOW",
    "RECENT_STEPS",
    "SETTLE_STEPS",
    "STACKS_SIGNAL",
    "Beat",
    "Wait",
    "compute_of",
    "hang_limit",
    "pace_of",
    "read_heartbeat",
]

STACKS_SIGNAL = signal.SIGUSR2
"""What the agent sends a worker it found hung, just before it kills it: the worker's
``faulthandler`` prints every thread's Python stack to stderr from its C handler, which
works while a thread holds the GIL. Not SIGUSR1: that is the interrupter's signal, whose
Python-level handler replaces faulthandler's and never runs in a GIL-holding hang."""


class Wait(enum.IntEnum):
    """What a worker's main thread waits on (:attr:`Beat.waits`): the judge follows the
    chain to its end (:func:`fastft.launch.rules.policy.waits_chain`)."""

    NONE = 0
    RUNTIME = 1
    """An interruptible wait of the runtime on its peers (a collective, a vote)."""
    PEER = 2
    """One named peer: a heal's other end (:attr:`Beat.on_rank`, :attr:`Beat.on_incarnation`)."""


BEAT_FORMAT = "<ddddddddddddq"
"""The heartbeat file: last beat, pace, between-steps since, commits, compute, step,
waiting since, unsettled since, the main thread's own last beat, what it waits on (a
:class:`Wait`), the rank of the peer it waits on, the epoch its figures were measured
in, and the incarnation of the peer it waits on (104 bytes)."""
BEAT_SIZE = struct.calcsize(BEAT_FORMAT)

RECENT_STEPS = 10
"""A worker's compute is the median of this many recent clean steps' (a straggler's is
slower for most of them)."""
PACE_WINDOW = 200
"""The pace is the 99th percentile of this many recent clean steps' longest silences (the
two largest of them are outliers, not the pace: a collector's pause, an evaluation every
100 steps; 10x the pace leaves room for a step 3x as long)."""


class Beat(NamedTuple):
    """One read of a worker's heartbeat file."""

    last: float
    """CLOCK_MONOTONIC of the last sign of life."""
    pace: float
    """The life's pace: the 99th percentile of its recent clean steps' longest silence of
    the main thread (seconds; 0 before its first clean commit)."""
    between: float
    """Since when the worker is between steps (0: inside one)."""
    commits: float
    """Steps this life committed."""
    compute: float
    """The median of its last :data:`RECENT_STEPS` clean steps' longest silence: how long
    its step computes (0 until it has that many)."""
    step: float = 0.0
    """The median of its last :data:`RECENT_STEPS` clean steps' wall time, commit to
    commit: the job's step time as this member sees it (0 until it has that many)."""
    waiting: float = 0.0
    """Since when the main thread waits in the runtime (a collective, a formation; 0: it
    does not): every member alive and waiting long is a network fault between them
    (:mod:`fastft.launch.gray.links`)."""
    unsettled: float = 0.0
    """Since when the worker is in a step after a recovery or a new epoch (0: it is not):
    the step may compile for a new world, so the helper thread beats while the interpreter
    runs (:meth:`HeartbeatWriter.unsettle`)."""
    main: float = 0.0
    """CLOCK_MONOTONIC of the main thread's own last beat (``last`` is the helper's while
    the worker waits, is between steps or unsettled): an unsettled step is hung when its
    main thread stops returning to the runtime, not when the peers it waits on are slow."""
    waits: float = 0.0
    """What the main thread waits on while ``waiting`` (a :class:`Wait`)."""
    on_rank: float = -1.0
    """:attr:`Wait.PEER`: the rank of the peer it waits on (-1: none named)."""
    epoch: float = 0.0
    """The epoch ``compute`` and ``step`` were measured in: a new epoch (a new world, a new
    share of the batch) starts them again (:meth:`HeartbeatWriter.new_world`); figures are
    compared only within one epoch."""
    on_incarnation: int = 0
    """:attr:`Wait.PEER`: that peer's incarnation."""


SETTLE_STEPS = 3
"""Commits after a recovery or a new epoch before the steps are the job's pace again
(:meth:`HeartbeatWriter.unsettle`)."""
HANG_PACES = 10.0
"""A worker in a step is hung after this many times its pace..."""
HANG_FLOOR_S = 0.5
"""...and at least this long (and at most ``--hang-timeout``): a step's compute varies
with the machine's load, a collector's pause or an evaluation inside the step."""


def hang_limit(pace: float, hang_timeout_s: float, *, by_pace: bool = True) -> float:
    """How long a worker in a step may stay silent before it is hung: ``HANG_PACES`` x its
    ``pace``, at least ``HANG_FLOOR_S`` and at most ``hang_timeout_s``; ``hang_timeout_s``
    alone before its pace is known (before its second clean commit) or without
    ``by_pace`` (``fastft run --no-hang-pace``)."""
    if not by_pace or pace <= 0:
        return hang_timeout_s
    return min(hang_timeout_s, max(HANG_FLOOR_S, HANG_PACES * pace))


def compute_of(silences: Sequence[float]) -> float:
    """The median of the last :data:`RECENT_STEPS` of ``silences`` (0: fewer)."""
    if len(silences) < RECENT_STEPS:
        return 0.0
    return statistics.median(list(silences)[-RECENT_STEPS:])


def pace_of(silences: Sequence[float]) -> float:
    """The 99th percentile of ``silences``: one in a hundred is an outlier (the largest of
    up to 99; of 200, the third largest)."""
    if not silences:
        return 0.0
    ordered = sorted(silences)
    return ordered[len(ordered) - 1 - len(ordered) // 100]


def read_heartbeat(path: str) -> Beat | None:
    """The worker's heartbeat file at ``path`` (see :class:`Beat`); None if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(BEAT_SIZE)
        return Beat(*struct.unpack(BEAT_FORMAT, data)) if len(data) == BEAT_SIZE else None
    except OSError:
        return None
