"""``fastft run``'s flags, built from :class:`~fastft.launch.settings.config.LaunchConfig`'s fields:
the argparse flags with their help and defaults, each falling back to its ``FASTFT_*``
variable (precedence: the flag, then the variable, then the default), and the config the
parsed flags describe."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from fastft.errors import ConfigError
from fastft.launch.settings.config import LaunchConfig
from fastft.process.env import parse_bool

__all__ = [
    "GROUPS",
    "add_run_flags",
    "config_from_args",
    "flag_rows",
    "flag_variables",
    "run_argv",
]

GROUPS: dict[str, tuple[str, ...]] = {
    "workers": (
        "nproc", "min_replicas", "max_restarts", "start_method", "preload", "warm_spares",
        "spare_cuda",
        "spare_prefault_mb", "spare_run_ahead", "backend", "seed",
    ),
    "faults and hangs": (
        "hang_timeout_s", "between_steps_timeout_s", "hang_pace", "start_grace_s",
        "stragglers", "straggler_factor",
        "max_recoveries", "health_host_mb", "quarantine", "drain_grace_s", "exit_trace",
        "keep_gradients", "inject",
    ),
    "durable tier (checkpoints)": (
        "checkpoint_dir", "checkpoint_every", "checkpoint_interval_s", "checkpoint_keep",
        "allow_fresh_start",
    ),
    "several nodes": (
        "nnodes", "node_rank", "store", "control", "job", "job_secret_file", "store_wait_s",
        "bus_relay", "standby",
        "node_heartbeat_ms", "node_lease_misses", "node_beats",
    ),
    "shard groups, sync policies, pipeline stages": (
        "shard_size", "sync", "stage", "flow", "flow_name", "max_ahead",
    ),
    "output and metrics": (
        "run_dir", "log_dir", "tee", "metrics_port", "metrics_addr", "check_every", "decide",
        "compare_every", "buffers",
    ),
    "torchft": ("torchft", "lighthouse_heartbeat_ms", "lighthouse_join_ms"),
}  # fmt: skip
"""``fastft run --help``'s sections (as torchrun groups its flags), by field name; every
flag is in one (a test says so)."""


def _flags() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(LaunchConfig) if f.metadata.get("help")]


def _flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _variable(f: dataclasses.Field[Any]) -> str:
    return "FASTFT_" + _flag_name(f)[2:].upper().replace("-", "_")


def flag_rows() -> list[tuple[str, str, str, str, str]]:
    """Every flag as (section, flag, default, variable, what), in ``--help``'s order,
    its default as the code has it (not the environment's): ``docs/flags.md``."""
    by_name = {f.name: f for f in _flags()}
    out = []
    for title, names in GROUPS.items():
        for name in names:
            f = by_name[name]
            if str(f.type).startswith("bool"):
                flag = "--no-" + _flag_name(f)[2:] if f.default else _flag_name(f)
                default = "on" if f.default else "off"
            else:
                flag, default = _flag_name(f), "none" if f.default is None else str(f.default)
            choices = f.metadata.get("choices")
            what = str(f.metadata["help"]) + (f" ({', '.join(choices)})" if choices else "")
            out.append((title, flag, default, _variable(f), what))
    return out


def flag_variables() -> dict[str, str]:
    """``FASTFT_*`` variable -> the ``fastft run`` flag it stands in for."""
    return {_variable(f): _flag_name(f) for f in _flags()}


def _from_env(f: dataclasses.Field[Any], env: Mapping[str, str]) -> Any:
    name = _variable(f)
    raw = env.get(name)
    if raw is None or raw == "":
        return f.default
    kind = str(f.type)
    try:
        if kind.startswith("bool"):
            return parse_bool(name, raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number") from None
    return raw


def add_run_flags(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Add one flag per :class:`LaunchConfig` field to ``p``, its default read from its
    variable in ``env`` (the process environment by default). Raises ConfigError for a
    malformed variable."""
    env = os.environ if env is None else env
    section: dict[str, Any] = {}
    for title, names in GROUPS.items():
        section.update(dict.fromkeys(names, p.add_argument_group(title)))
    for f in _flags():
        g = section.get(f.name, p)
        default = _from_env(f, env)
        var = _variable(f)
        shown = "none" if default is None else default
        kind = str(f.type)
        if kind.startswith("bool"):
            if f.default:  # on unless turned off
                g.add_argument(
                    "--no-" + _flag_name(f)[2:],
                    dest=f.name,
                    action="store_false",
                    default=default,
                    help=f"do not: {f.metadata['help']} [on by default; env {var}=0]",
                )
            else:
                g.add_argument(
                    _flag_name(f),
                    dest=f.name,
                    action="store_true",
                    default=default,
                    help=f"{f.metadata['help']} [off by default; env {var}=1]",
                )
            continue
        typ = int if kind.startswith("int") else float if kind.startswith("float") else str
        g.add_argument(
            _flag_name(f),
            dest=f.name,
            type=typ,
            default=default,
            choices=f.metadata["choices"] or None,
            help=f"{f.metadata['help']} [default: {shown}; env {var}]",
        )
    _aliases(p)


def _aliases(p: argparse.ArgumentParser) -> None:
    """Flags of earlier releases, still accepted: ``--adaptive-hang`` (now the default,
    judged by the worker's pace)."""
    p.add_argument("--adaptive-hang", dest="hang_pace", action="store_true", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace, command: tuple[str, ...]) -> LaunchConfig:
    """The config the parsed flags describe; raises ConfigError for a bad combination."""
    return LaunchConfig(command=command, **{f.name: getattr(args, f.name) for f in _flags()})


def run_argv(args: argparse.Namespace, skip: frozenset[str] = frozenset()) -> list[str]:
    """The ``fastft run`` flags that reproduce ``args`` (those not at their default, and
    not in ``skip``, by field name): what ``fastft ray run`` hands each node's agent."""
    out: list[str] = []
    for f in _flags():
        value = getattr(args, f.name)
        if f.name in skip or value == f.default:
            continue
        if str(f.type).startswith("bool"):
            out.append(_flag_name(f) if value else "--no-" + _flag_name(f)[2:])
        else:
            out += [_flag_name(f), str(value)]
    return out
