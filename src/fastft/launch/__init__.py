"""The node agent and launcher: ``fastft run``. Imported lazily: the CLI builds its
``run`` flags from :mod:`fastft.launch.settings.config` without importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastft.launch.agent import Agent
    from fastft.launch.settings.config import LaunchConfig

__all__ = ["Agent", "LaunchConfig"]


def __getattr__(name: str) -> Any:
    if name == "Agent":
        from fastft.launch.agent import Agent

        return Agent
    if name == "LaunchConfig":
        from fastft.launch.settings.config import LaunchConfig

        return LaunchConfig
    raise AttributeError(f"module 'fastft.launch' has no attribute {name!r}")
