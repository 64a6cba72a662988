"""The node agent and launcher: ``fastft run``."""

from fastft.launch.agent import Agent, LaunchConfig

__all__ = ["Agent", "LaunchConfig"]
