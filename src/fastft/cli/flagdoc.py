"""``docs/flags.md``: every ``fastft run`` flag and ``fastft ray run``'s own, generated from
:class:`~fastft.launch.settings.config.LaunchConfig` and the CLI's parser, so the reference cannot
drift from the code (``make flags-doc``; ``tests/unit/test_docs.py`` keeps them equal)::

    python -m fastft.cli.flagdoc > docs/flags.md
"""

from __future__ import annotations

import argparse

from fastft.launch.settings.flags import flag_rows

__all__ = ["render"]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _ray_rows() -> list[tuple[str, str, str]]:
    """``fastft ray run``'s own flags (beside every ``fastft run`` flag)."""
    from fastft.cli import _build, actions, subcommands

    run = subcommands(subcommands(_build())["ray"])["run"]
    mine = {flag for _, flag, *_ in flag_rows()}
    out = []
    for a in actions(run):
        flags = [o for o in a.option_strings if o.startswith("--")]
        if not flags or a.dest == "help" or a.help == argparse.SUPPRESS:
            continue
        if flags[0] in mine or f"--{a.dest.replace('_', '-')}" in mine or a.dest == "module":
            continue
        default = "none" if a.default is None else str(a.default)
        out.append((flags[0], default, _cell(a.help or "")))
    return out


def render() -> str:
    lines = [
        "# Flags: `fastft run` and `fastft ray run`",
        "",
        "Generated from `fastft.launch.settings.config.LaunchConfig` and the CLI's parser by",
        "`make flags-doc` (`python -m fastft.cli.flagdoc > docs/flags.md`); a test keeps it",
        "equal to the code. Every `fastft run` flag falls back to its environment variable;",
        "a bad value fails at start with exit status 2. `fastft run --help` says the same,",
        "with the defaults your environment sets. Exit statuses:",
        "[operating.md](operating.md#exit-statuses).",
        "",
    ]
    section = None
    for title, flag, default, var, what in flag_rows():
        if title != section:
            section = title
            lines += [
                f"## {title[0].upper()}{title[1:]}",
                "",
                "| flag | default | variable | what |",
                "|---|---|---|---|",
            ]
        lines.append(f"| `{flag}` | {_cell(default) or 'none'} | `{var}` | {_cell(what)} |")
    out = []
    for i, line in enumerate(lines):  # (a blank line after each table)
        out.append(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.startswith("| `") and nxt.startswith("## "):
            out.append("")
    out += [
        "",
        "## `fastft ray run`'s own (beside every flag above)",
        "",
        "| flag | default | what |",
        "|---|---|---|",
    ]
    out += [f"| `{f}` | {_cell(d)} | {w} |" for f, d, w in _ray_rows()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
