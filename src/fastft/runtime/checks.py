"""The checks a configuration passes at start (pure): shard groups, sync policies,
pipeline stages, the durable tier. Each says what to fix in one line."""

from __future__ import annotations

from fastft.errors import ConfigError

__all__ = [
    "CHECKPOINT_INTERVAL_S",
    "DECIDE",
    "DECIDE_AUTO_MEMBERS",
    "by_collective",
    "check_checkpoints",
    "check_decide",
    "check_shard_groups",
    "check_stage",
    "check_sync",
]


def check_sync(sync: str) -> int:
    """The sync policy's period: 1 for ``per-step``, N for ``every-k:N`` and ``diloco:N``."""
    if sync == "per-step":
        return 1
    kind, _, n = sync.partition(":")
    if kind not in ("every-k", "diloco") or not n.isdigit() or int(n) < 1:
        raise ConfigError(f"--sync {sync!r}: use per-step, every-k:N or diloco:N (N >= 1 steps)")
    return int(n)


DECIDE = ("auto", "collective", "store")
"""``--decide``: how a fault-free step is decided (docs/architecture.md)."""
DECIDE_AUTO_MEMBERS = 16
"""``--decide auto``: from this many members on, the step's collective decides."""


def check_decide(decide: str) -> str:
    if decide not in DECIDE:
        raise ConfigError(f"--decide {decide!r}: use auto, collective or store")
    return decide


def by_collective(decide: str, members: int, backend: str, nats: bool) -> bool:
    """Whether an epoch of ``members`` decides a fault-free step by an allreduce of its
    own after the gradients (else every member votes in the store), where the vote could
    not ride the gradients' allreduce (:mod:`fastft.runtime.state.inband`: where it did, every
    mode but ``store`` takes its word). ``auto`` picks the cheaper: the collective on
    NCCL (a small allreduce on the job's own network costs less than a store round
    trip), on the NATS control plane (whose vote is a compare-and-set loop on replicated
    keys: 9-13 ms a step here) and from :data:`DECIDE_AUTO_MEMBERS` members on (the
    store's one server thread spends ~50 µs per member and step); the store's vote for a
    small Gloo job, where one more allreduce cost more than the vote (1.6-2 ms against
    ~0.5 ms with 3 processes on 2 cores: docs/measurements.md). Every member of an epoch
    computes the same (one configuration, one view)."""
    if decide != "auto":
        return decide == "collective"
    return backend == "nccl" or nats or members >= DECIDE_AUTO_MEMBERS


def check_stage(
    stage: str | None, flow: str | None, max_ahead: int, elastic: bool, shard_size: int
) -> tuple[int, int]:
    """A pipeline stage's configuration (:mod:`fastft.runtime.groups.flow`): (I, S), (0, 1) for a
    job that is no stage."""
    if stage is None:
        if flow is not None:
            raise ConfigError("--flow without --stage I/S: say which stage this job is")
        return 0, 1
    i = stage.partition("/")[0]
    s = stage.partition("/")[2]
    if not (i.isdigit() and s.isdigit()) or not 0 <= int(i) < int(s):
        raise ConfigError(
            f"--stage {stage!r}: use I/S, the stage's index I of S stages (0 <= I < S)"
        )
    if int(s) > 1 and flow is None:
        raise ConfigError(
            f"--stage {stage} without --flow HOST:PORT: the stages meet in a flow store "
            "(fastft store hosts one)"
        )
    if max_ahead < 1:
        raise ConfigError(f"--max-ahead {max_ahead}: must be >= 1")
    if elastic or shard_size > 1:
        raise ConfigError(
            f"--stage with --{'min-replicas' if elastic else 'shard-size'}: pipeline stages "
            "are built for fixed worlds of one worker per replica; leave it out"
        )
    return int(i), int(s)


def check_shard_groups(shard_size: int, world_size: int, min_members: int) -> None:
    """Shard groups must tile the world, and an epoch of whole groups its fewest members."""
    if shard_size < 1:
        raise ConfigError(f"--shard-size {shard_size}: must be >= 1")
    if world_size % shard_size:
        raise ConfigError(
            f"--shard-size {shard_size} does not divide the {world_size} workers: use a "
            "divisor of --nproc (times --nnodes)"
        )
    if shard_size > 1 and min_members % shard_size:
        raise ConfigError(
            f"--min-replicas {min_members} with --shard-size {shard_size}: an epoch has whole "
            "shard groups, so the fewest workers must be a multiple of the group size"
        )


CHECKPOINT_INTERVAL_S = 600.0
"""With a checkpoint directory and neither schedule given: a checkpoint every 10 minutes."""


def check_checkpoints(directory: str | None, every: int, interval_s: float, keep: int) -> None:
    """The checkpoint settings, checked where they are given (``fastft run`` and each
    worker): a ConfigError that says what to fix."""
    if every < 0:
        raise ConfigError(f"--checkpoint-every {every}: use 0 (off) or a number of steps")
    if not interval_s >= 0 or interval_s == float("inf"):
        raise ConfigError(f"--checkpoint-interval {interval_s}: use 0 (off) or seconds > 0")
    if keep < 1:
        raise ConfigError(f"--checkpoint-keep {keep}: keep at least 1")
    if (every or interval_s) and not directory:
        raise ConfigError("--checkpoint-every/--checkpoint-interval need --checkpoint-dir DIR")
