"""A standby agent (``fastft run --standby``): a node's agent started before it is
needed, so that a node whose agent died is back in a fraction of a second instead of a
new process's start (``fastft ray run`` keeps one beside each node's agent).

It parses its flags, starts the node's zygote (torch, fastft and the script's modules
imported: the seconds of a start) and imports the agent's store client, says it is warm
(one line), then waits for one line on stdin, touching nothing of the job meanwhile: no
store, no lease, no event in the run directory. The line (a JSON object of variables to
set, ``{}`` for none) means "this node's agent is dead": the agent starts with the warm
zygote and takes the node over (:meth:`fastft.launch.nodes.lease.NodeLease.take_over`: the
workers the dead agent left are declared dead at once, not after the lease). End of stdin
instead: the standby was not needed; it exits 0.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from fastft.launch.procs.children import die_with_parent
from fastft.launch.procs.forks import Zygote, start_zygote
from fastft.launch.procs.output import Output

__all__ = ["Warm", "node_zygote", "wait_for_go", "warm_up"]


@dataclass
class Warm:
    """What a standby prepared for its agent: the output relay its zygote writes through,
    and the zygote (None with ``--start-method spawn``, or why the job cannot start)."""

    output: Output
    zygote: Zygote | None = None
    why: str | None = None
    held: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """The zygote's events before the agent's event log exists."""

    def emit(self, event: str, **fields: Any) -> None:
        self.held.append((event, fields))

    def hand_over(self, emit: Callable[..., None]) -> tuple[Zygote | None, str | None]:
        """The zygote for the agent (as :func:`~fastft.launch.procs.forks.start_zygote` returns
        it), its events from now on in the agent's log (``emit``), the held ones first."""
        for event, fields in self.held:
            emit(event, **fields)
        self.held.clear()
        if self.zygote is not None:
            self.zygote.emit = emit
        return self.zygote, self.why


def warm_up(config: Any) -> Warm:
    """Start the node's zygote for ``config`` (a LaunchConfig) and import what the agent
    imports once it joins (``torch.distributed``: 1.3 s here, on either control plane;
    the NATS client); return when the zygote is warm."""
    import torch.distributed  # noqa: F401

    if config.control:
        import nats  # noqa: F401
    warm = Warm(Output(config.log_dir, config.tee))
    warm.zygote, warm.why = start_zygote(config, warm.output, warm.emit, die_with_parent)
    return warm


def node_zygote(
    config: Any, warm: Warm | None, output: Output, emit: Callable[..., None]
) -> tuple[Zygote | None, str | None]:
    """The agent's zygote: the standby's, warm (``warm``), else one started now."""
    if warm is not None:
        return warm.hand_over(emit)
    return start_zygote(config, output, emit, die_with_parent)


def wait_for_go(stream: IO[str] | None = None) -> dict[str, str] | None:
    """Block until a line comes on ``stream`` (stdin): take the node over, with the
    variables the line sets (a JSON object: the dead agent's ``CUDA_VISIBLE_DEVICES``;
    anything else sets none); None at its end (not needed)."""
    line = (stream or sys.stdin).readline()
    if not line:
        return None
    try:
        got = json.loads(line)
    except ValueError:
        return {}
    if not isinstance(got, dict):
        return {}
    return {str(k): str(v) for k, v in got.items()}
