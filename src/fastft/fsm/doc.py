"""Render the transition table as Markdown + a Mermaid diagram (``docs/fsm.md``)."""

from __future__ import annotations

from fastft.fsm.contract import Phase
from fastft.fsm.table import TABLE

__all__ = ["render"]


def render() -> str:
    lines = [
        "# Step state machine",
        "",
        "Generated from `fastft.fsm.table.TABLE` by `fastft fsm-doc > docs/fsm.md`;",
        "a test fails when this file is out of date. Self-loops that only ignore or latch",
        "an event are listed in the table, not drawn.",
        "",
        "```mermaid",
        "stateDiagram-v2",
        "    [*] --> INIT",
    ]
    edges: dict[tuple[str, str], list[str]] = {}
    for (phase, event), rule in TABLE.items():
        for target in rule.targets:
            if target is phase:
                continue
            edges.setdefault((phase.name, target.name), []).append(event.__name__)
    for (src, dst), events in sorted(edges.items()):
        lines.append(f"    {src} --> {dst}: {', '.join(sorted(set(events)))}")
    lines += [
        "    EXIT --> [*]",
        "```",
        "",
        "| phase | event | may lead to | what happens |",
        "|---|---|---|---|",
    ]
    for phase in Phase:
        for (p, event), rule in TABLE.items():
            if p is phase:
                targets = ", ".join(t.name for t in dict.fromkeys(rule.targets))
                lines.append(f"| {p.name} | {event.__name__} | {targets} | {rule.doc} |")
    lines += ["", "Any (phase, event) pair not listed raises `InvalidTransition`.", ""]
    return "\n".join(lines)
