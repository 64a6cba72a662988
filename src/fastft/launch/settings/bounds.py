"""The numeric bounds of ``fastft run``'s flags (pure): each a ConfigError that names the
flag and what it may be, checked at start (exit status 2)."""

from __future__ import annotations

from typing import Any

from fastft.errors import ConfigError
from fastft.process.malloc import PREFAULT_MAX

__all__ = ["BUFFERS", "PREFAULT_MAX_MB", "check_bounds", "check_torchft"]

BUFFERS = ("average", "local")
"""``--buffers``: the model's floating buffers averaged over the members with each step's
gradients, or each member's own."""
PREFAULT_MAX_MB = PREFAULT_MAX >> 20


def check_bounds(cfg: Any) -> None:
    """The ConfigError of the first flag of ``cfg`` (a LaunchConfig) out of its bounds."""
    if cfg.max_restarts < 0:
        raise ConfigError("--max-restarts must be >= 0")
    if cfg.max_recoveries < 1:
        raise ConfigError(f"--max-recoveries {cfg.max_recoveries}: must be >= 1")
    if cfg.hang_timeout_s <= 0:
        raise ConfigError("--hang-timeout must be > 0 seconds")
    if cfg.between_steps_timeout_s <= 0:
        raise ConfigError("--between-steps-timeout must be > 0 seconds")
    if not 1 < cfg.straggler_factor <= 100:
        raise ConfigError(
            f"--straggler-factor {cfg.straggler_factor}: use a factor above 1 (1.3: 30 % "
            "slower than the others) and at most 100"
        )
    if cfg.metrics_port is not None and not 0 <= cfg.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {cfg.metrics_port}: use 0..65535")
    if cfg.metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--metrics-port needs the prometheus-client package: pip install 'fastft[metrics]'"
            ) from None
    if cfg.tee not in (0, 1, 2, 3):
        raise ConfigError(f"--tee {cfg.tee}: use 0 (none), 1 (stdout), 2 (stderr) or 3")
    if cfg.health_host_mb < 0:
        raise ConfigError(f"--health-host-mb {cfg.health_host_mb}: must be >= 0")
    if not 0 < cfg.drain_grace_s < 86400:
        raise ConfigError(f"--drain-grace {cfg.drain_grace_s}: use 0 < seconds < 86400")
    if not 0 <= cfg.warm_spares <= cfg.nproc:
        raise ConfigError(f"--warm-spares {cfg.warm_spares}: use 0..{cfg.nproc}")
    if not 0 <= cfg.spare_prefault_mb <= PREFAULT_MAX_MB:
        raise ConfigError(
            f"--spare-prefault-mb {cfg.spare_prefault_mb}: use 0..{PREFAULT_MAX_MB} "
            "(memory kept mapped above glibc's trim threshold would be returned)"
        )
    if cfg.compare_every < 0:
        raise ConfigError(f"--compare-every {cfg.compare_every}: use 0 (off) or N >= 1")


def check_torchft(cfg: Any) -> None:
    """``--torchft``'s ConfigError: its value, its timeouts, and torchft installed."""
    if cfg.torchft not in (None, "fastft", "plain"):
        raise ConfigError(f"--torchft {cfg.torchft!r}: use fastft or plain")
    if cfg.torchft is None:
        return
    if cfg.lighthouse_heartbeat_ms < 1 or cfg.lighthouse_join_ms < 1:
        raise ConfigError("--lighthouse-heartbeat-ms and --lighthouse-join-ms must be >= 1")
    try:
        import torchft  # noqa: F401

        if cfg.torchft == "fastft":
            import grpc  # noqa: F401  (BusLighthouse)
    except ImportError as e:
        raise ConfigError(f"--torchft needs torchft: pip install 'fastft[torchft]' ({e})") from e
